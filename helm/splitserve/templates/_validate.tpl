{{/*
Cross-field rules that values.schema.json cannot express. Each failure names the values involved,
what was expected and what was found. Included once, from configmap.yaml.
*/}}
{{- define "splitserve.validate" -}}
{{- $f := .Values.fleet -}}
{{- if $f.hpa.enabled -}}
{{- if gt (int $f.hpa.minReplicas) (int $f.hpa.maxReplicas) -}}
{{- fail (printf "fleet.hpa.minReplicas (%v) must be <= fleet.hpa.maxReplicas (%v)" $f.hpa.minReplicas $f.hpa.maxReplicas) -}}
{{- end -}}
{{- if not (and $f.resources $f.resources.requests (hasKey $f.resources.requests "cpu")) -}}
{{- fail "fleet.hpa.enabled scales on CPU utilization, which needs fleet.resources.requests.cpu; found none" -}}
{{- end -}}
{{- end -}}
{{- if gt (addf $f.drainTimeoutSeconds 5) (float64 $f.terminationGracePeriodSeconds) -}}
{{- fail (printf "fleet.terminationGracePeriodSeconds (%v) must cover the 5 s preStop plus fleet.drainTimeoutSeconds (%v)" $f.terminationGracePeriodSeconds $f.drainTimeoutSeconds) -}}
{{- end -}}
{{- range $role := list "context" "generation" -}}
{{- $w := include "splitserve.workerSettings" (dict "root" $ "role" $role) | fromYaml -}}
{{- $p := $w.ports -}}
{{- $ports := list (int $p.http) (int $p.kvEvents) (int $p.kvReplay) (int $p.transfer) -}}
{{- if ne (len ($ports | uniq)) 4 -}}
{{- fail (printf "workers.%s.ports: http, kvEvents, kvReplay and transfer must be four different ports; found %v" $role $ports) -}}
{{- end -}}
{{- $urls := (index $.Values.cluster $role).urls -}}
{{- if and (not $w.enabled) (not $urls) -}}
{{- fail (printf "no %s servers: workers.%s.enabled is false and cluster.%s.urls is empty; enable the workers or list static urls" $role $role $role) -}}
{{- end -}}
{{- if ge (float64 $w.drainTimeoutSeconds) (float64 $w.terminationGracePeriodSeconds) -}}
{{- fail (printf "workers.%s.terminationGracePeriodSeconds (%v) must exceed drainTimeoutSeconds (%v), or draining workers are killed" $role $w.terminationGracePeriodSeconds $w.drainTimeoutSeconds) -}}
{{- end -}}
{{- if and (eq $w.engine "torch") (gt (mul (int $w.tpSize) (int $w.ppSize)) 1) -}}
{{- fail (printf "workers.%s: the reference torch engine runs one device per worker; found tpSize %v x ppSize %v (use 1 and 1 and scale with replicas)" $role $w.tpSize $w.ppSize) -}}
{{- end -}}
{{- if and (eq $w.engine "sim") (eq $w.device "cuda") -}}
{{- fail (printf "workers.%s: engine sim runs no model and needs no GPU; set device: cpu (found device: cuda)" $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
