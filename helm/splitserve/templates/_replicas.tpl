{{/* Headless Service of the coordinator replicas (their per-pod DNS records). */}}
{{- define "splitserve.coordinatorHeadlessName" -}}
{{- printf "%s-hl" (include "splitserve.coordinatorName" .) -}}
{{- end -}}

{{/* The ordered coordinator replica URLs (pod DNS records), one per line; empty with one replica. */}}
{{- define "splitserve.coordinatorReplicaUrls" -}}
{{- $n := int .Values.coordinator.replicas -}}
{{- if gt $n 1 -}}
{{- $name := include "splitserve.coordinatorName" . -}}
{{- $hl := include "splitserve.coordinatorHeadlessName" . -}}
{{- range $i := until $n }}
{{ printf "http://%s-%d.%s.%s.svc:%d" $name $i $hl $.Release.Namespace (int $.Values.coordinator.port) }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* What a worker registers with: every replica (comma separated), else the coordinator Service. */}}
{{- define "splitserve.coordinatorRegistrationUrl" -}}
{{- $urls := include "splitserve.coordinatorReplicaUrls" . | trim -}}
{{- if $urls -}}
{{- splitList "\n" $urls | join "," -}}
{{- else -}}
{{- include "splitserve.coordinatorUrl" . -}}
{{- end -}}
{{- end -}}
