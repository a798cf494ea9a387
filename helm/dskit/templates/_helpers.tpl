{{/*
Names. The Job, its headless Service and the pods' subdomain share one name, so pod i is reachable at
NAME-i.NAME. 52 characters at most: Kubernetes appends "-INDEX" and a 5-character suffix to pod names,
and a hostname is at most 63.
*/}}
{{- define "dskit.fullname" -}}
{{- $name := default .Release.Name .Values.fullnameOverride -}}
{{- if gt (len $name) 52 -}}
{{- fail (printf "release name %q is longer than 52 characters; pass a shorter name or set fullnameOverride" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "dskit.selectorLabels" -}}
app.kubernetes.io/name: dskit
app.kubernetes.io/instance: {{ .Release.Name | toJson }}
{{- end -}}

{{- define "dskit.labels" -}}
{{ include "dskit.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service | toJson }}
app.kubernetes.io/version: {{ .Chart.AppVersion | toJson }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | toJson }}
{{- end -}}

{{- define "dskit.claimName" -}}
{{- default (printf "%s-storage" (include "dskit.fullname" .)) .Values.storage.existingClaim -}}
{{- end -}}

{{/*
The plan (run.yaml) is the trainer's only input, and it fixes the world size: refuse values whose
node and process counts disagree with it, rather than start pods that would hang in the rendezvous.
*/}}
{{- define "dskit.checkPlan" -}}
{{- $plan := fromYaml (required "plan is empty: write the values with `dskit render helm`, then helm install -f values.yaml" .Values.plan) -}}
{{- if hasKey $plan "Error" -}}
{{- fail (printf "plan is not valid YAML: %s" $plan.Error) -}}
{{- end -}}
{{- $hw := get $plan "hardware" -}}
{{- if not (kindIs "map" $hw) -}}
{{- if .Values.plan -}}
{{- fail "plan has no hardware section: write the values with `dskit render helm`" -}}
{{- end -}}
{{- else -}}
{{- if ne (int $hw.nodes) (int .Values.nodes) -}}
{{- fail (printf "nodes is %d but the plan is for %d nodes: change the spec and re-render with `dskit render helm`" (int .Values.nodes) (int $hw.nodes)) -}}
{{- end -}}
{{- if ne (int $hw.procs_per_node) (int .Values.procsPerNode) -}}
{{- fail (printf "procsPerNode is %d but the plan has %d per node: re-render with `dskit render helm`" (int .Values.procsPerNode) (int $hw.procs_per_node)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
