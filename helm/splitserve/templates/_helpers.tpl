{{/*
Names. Every object name is "<fullname>-<component>"; fullname is capped at 40 characters so the
longest suffix ("-generation", 11) still fits the 63-character DNS-1123 label limit, and a
StatefulSet pod name plus its controller-revision-hash label stays within 63 as well.
*/}}
{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "splitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component. Call with (dict "root" $ "component" "fleet"). */}}
{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Full label set of one component's objects. */}}
{{- define "splitserve.labels" -}}
{{ include "splitserve.selectorLabels" . }}
helm.sh/chart: {{ include "splitserve.chart" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels of one component's pods: selector labels plus user pod labels. */}}
{{- define "splitserve.podLabels" -}}
{{ include "splitserve.labels" . }}
{{- with .root.Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Image reference. Call with (dict "root" $ "override" <map with repository/tag or nil>). */}}
{{- define "splitserve.image" -}}
{{- $o := default dict .override -}}
{{- $repo := default .root.Values.image.repository $o.repository -}}
{{- $tag := default (default .root.Chart.AppVersion .root.Values.image.tag) $o.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "splitserve.configMapName" -}}
{{- printf "%s-config" (include "splitserve.fullname" .) -}}
{{- end -}}

{{- define "splitserve.coordinatorName" -}}
{{- printf "%s-coordinator" (include "splitserve.fullname" .) -}}
{{- end -}}

{{/* In-cluster URL of the coordinator Service, used by the fleet and by worker self-registration. */}}
{{- define "splitserve.coordinatorUrl" -}}
{{- printf "http://%s.%s.svc:%d" (include "splitserve.coordinatorName" .) .Release.Namespace (int .Values.coordinator.service.port) -}}
{{- end -}}

{{/* Settings of one worker role: workers.defaults deep-merged with workers.<role>. */}}
{{- define "splitserve.workerSettings" -}}
{{- $role := index .root.Values.workers .role | default dict -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.workers.defaults) (deepCopy $role)) -}}
{{- end -}}

{{/* Path of the mounted cluster config inside every control-plane pod. */}}
{{- define "splitserve.configPath" -}}/etc/splitserve/cluster.yaml{{- end -}}

{{/*
Pod annotations: config checksum (a changed cluster.yaml rolls the pods), prometheus.io scrape
hints for the port serving /metrics, then the user's podAnnotations.
Call with (dict "root" $ "port" <int> "config" <bool>).
*/}}
{{- define "splitserve.podAnnotations" -}}
{{- $a := dict -}}
{{- if .config -}}
{{- $_ := set $a "checksum/config" (include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum) -}}
{{- end -}}
{{- if .root.Values.metrics.podAnnotations -}}
{{- $_ := set $a "prometheus.io/scrape" "true" -}}
{{- $_ := set $a "prometheus.io/port" (toString .port) -}}
{{- $_ := set $a "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- $a = merge (deepCopy .root.Values.podAnnotations) $a -}}
{{- if $a }}{{ toYaml $a }}{{ end -}}
{{- end -}}

{{/*
Credentials for the fleet, from existing Secrets (never inlined). The fleet alone needs them: it
checks client API keys and signs disaggregated_params. The ConfigMap does not name api_keys_env
(the coordinator reads the same file and would then demand the keys too); the fleet gets it as
an environment override instead.
*/}}
{{- define "splitserve.fleetAuthEnv" -}}
{{- with .Values.auth.apiKeys.existingSecret }}
- name: SPLITSERVE_API_KEYS_ENV
  value: SPLITSERVE_API_KEYS
- name: SPLITSERVE_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.auth.apiKeys.key }}
{{- end }}
{{- with .Values.auth.internalAuth.existingSecret }}
- name: SPLITSERVE_INTERNAL_REQUEST_AUTH_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.auth.internalAuth.key }}
{{- end }}
{{- end -}}

{{/* Probe timing fields from values (the probe target is fixed by the template). */}}
{{- define "splitserve.probeTiming" -}}
{{- $o := dict -}}
{{- range $k := list "initialDelaySeconds" "periodSeconds" "timeoutSeconds" "failureThreshold" "successThreshold" -}}
{{- if hasKey $.probe $k }}{{ $_ := set $o $k (index $.probe $k) }}{{ end -}}
{{- end -}}
{{- if $o }}{{ toYaml $o }}{{ end -}}
{{- end -}}

{{/* A NetworkPolicy peer: the pods of one component of this release. */}}
{{- define "splitserve.npPeer" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ .name }}
      app.kubernetes.io/instance: {{ .instance }}
      app.kubernetes.io/component: {{ .component }}
{{- end -}}
