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

{{/*
The pods' hostname prefix: pod i is PREFIX-i, reachable at PREFIX-i.NAME. An Indexed Job names its
pods after itself; a JobSet names its child Job NAME-node-0 (<jobset>-<replicated job>-<job index>),
and so does the JobSet a TrainJob's torch runtime makes (its replicated job is named node too).
*/}}
{{- define "dskit.podPrefix" -}}
{{- $name := include "dskit.fullname" . -}}
{{- if eq .Values.workload "job" -}}
{{- $name -}}
{{- else -}}
{{- printf "%s-node-0" $name -}}
{{- end -}}
{{- end -}}

{{/*
A JobSet's pods are named NAME-node-0-INDEX-xxxxx and JobSet's webhook requires an RFC 1035 label
(as the Trainer does of a TrainJob's name): fail here rather than at submission.
*/}}
{{- define "dskit.checkGroupName" -}}
{{- $longest := printf "%s-%d-xxxxx" (include "dskit.podPrefix" .) (sub (int .Values.nodes) 1) -}}
{{- if or (gt (len $longest) 63) (not (regexMatch "^[a-z]" $longest)) -}}
{{- fail (printf "a %s's pods are named like %q, which must start with a letter and fit 63 characters: pass a shorter release name or set fullnameOverride" .Values.workload $longest) -}}
{{- end -}}
{{- end -}}

{{/*
The workload object's labels: dskit.labels, plus Kueue's queue and priority class when a queue is set.
*/}}
{{- define "dskit.workloadLabels" -}}
{{ include "dskit.labels" . }}
{{- with .Values.kueue }}
{{- if and (or .priorityClass .topology) (not .queueName) }}
{{- fail "kueue.priorityClass and kueue.topology need kueue.queueName (the LocalQueue)" }}
{{- end }}
{{- with .queueName }}
kueue.x-k8s.io/queue-name: {{ . | toJson }}
{{- end }}
{{- with .priorityClass }}
kueue.x-k8s.io/priority-class: {{ . | toJson }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Kueue's topology request, a pod template annotation: all pods within one domain of the level
(required), or as few domains as fit (preferred). Empty without kueue.topology.
*/}}
{{- define "dskit.kueueTopology" -}}
{{- with .Values.kueue.topology -}}
{{- if not $.Values.kueue.topologyLevel -}}
{{- fail "kueue.topology needs kueue.topologyLevel (a node label of the cluster's Kueue Topology)" -}}
{{- end -}}
kueue.x-k8s.io/podset-{{ . }}-topology: {{ $.Values.kueue.topologyLevel | toJson }}
{{- end -}}
{{- end -}}
