{{/*
The coordinator's pod template, shared by its single-replica Deployment (coordinator.yaml) and its
replica StatefulSet (coordinator-replicas.yaml). With replicas, pods prefer (antiAffinity: soft) or
require (hard) different nodes, unless `coordinator.affinity` is given.
*/}}
{{- define "splitserve.coordinatorPodTemplate" -}}
{{- $v := .Values.coordinator -}}
{{- $ctx := dict "root" . "component" "coordinator" -}}
metadata:
  labels:
    {{- include "splitserve.podLabels" $ctx | nindent 4 }}
  {{- with include "splitserve.podAnnotations" (dict "root" . "port" $v.port "config" true) }}
  annotations:
    {{- . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "splitserve.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.automountServiceAccountToken }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  containers:
    - name: coordinator
      image: {{ include "splitserve.image" (dict "root" .) }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: ["splitserve"]
      args:
        - coordinator
        - --config
        - {{ include "splitserve.configPath" . }}
        - --host
        - 0.0.0.0
        - --port
        - {{ $v.port | quote }}
        - --uds
        - /run/splitserve/coordinator.sock
        - --log-level
        - {{ $v.logLevel }}
        {{- range $v.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      {{- with $v.extraEnv }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        - name: http
          containerPort: {{ $v.port }}
          protocol: TCP
      # /health is *cluster* readiness (503 until each role has its minimum of healthy
      # workers). Probing it would hide the coordinator from the very workers that must
      # register through this Service, and restart it while they load. /version answers
      # 200 whenever the coordinator's event loop serves HTTP.
      startupProbe:
        httpGet:
          path: /version
          port: http
        {{- include "splitserve.probeTiming" (dict "probe" $v.probes.startup) | nindent 8 }}
      livenessProbe:
        httpGet:
          path: /version
          port: http
        {{- include "splitserve.probeTiming" (dict "probe" $v.probes.liveness) | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /version
          port: http
        {{- include "splitserve.probeTiming" (dict "probe" $v.probes.readiness) | nindent 8 }}
      resources:
        {{- toYaml $v.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.controlPlaneSecurityContext | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/splitserve
          readOnly: true
        - name: tmp
          mountPath: /tmp
        - name: run
          mountPath: /run/splitserve
  volumes:
    - name: config
      configMap:
        name: {{ include "splitserve.configMapName" . }}
    - name: tmp
      emptyDir: {}
    - name: run
      emptyDir:
        medium: Memory
        sizeLimit: 16Mi
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $v.affinity }}
  affinity:
    {{- toYaml $v.affinity | nindent 4 }}
  {{- else if and (gt (int $v.replicas) 1) (ne $v.antiAffinity "none") }}
  affinity:
    podAntiAffinity:
      {{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "splitserve.selectorLabels" $ctx | fromYaml)) }}
      {{- if eq $v.antiAffinity "hard" }}
      requiredDuringSchedulingIgnoredDuringExecution:
        {{- toYaml (list $term) | nindent 8 }}
      {{- else }}
      preferredDuringSchedulingIgnoredDuringExecution:
        {{- toYaml (list (dict "weight" 100 "podAffinityTerm" $term)) | nindent 8 }}
      {{- end }}
  {{- end }}
{{- end -}}
