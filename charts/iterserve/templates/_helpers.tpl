{{/* Names, labels and images shared by the chart's templates. */}}

{{- define "iterserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-iterserve (or the release's name when it already holds the chart's). */}}
{{- define "iterserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of the release's cluster-scoped objects (ClusterRole, ClusterRoleBinding):
<fullname>-<release namespace>, so that releases in different namespaces (one operator per
team, each with its watchNamespaces) own different objects. At most 127 characters (RBAC
names are path segments, not DNS labels). */}}
{{- define "iterserve.clusterName" -}}
{{- printf "%s-%s" (include "iterserve.fullname" .) .Release.Namespace }}
{{- end }}

{{/* A Prometheus duration (values.schema.json's grammar: 1h30m, 15s, 500ms, 0) in
milliseconds. */}}
{{- define "iterserve.durationMs" -}}
{{- $re := "^(?:([0-9]+)y)?(?:([0-9]+)w)?(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?(?:([0-9]+)ms)?$" }}
{{- $ms := 0 }}
{{- if ne . "0" }}
{{- range $i, $unit := list 31536000000 604800000 86400000 3600000 60000 1000 1 }}
{{- $n := regexReplaceAll $re $ (printf "${%d}" (add1 $i)) }}
{{- if $n }}
{{- $ms = add $ms (mul (atoi $n) $unit) }}
{{- end }}
{{- end }}
{{- end }}
{{- $ms }}
{{- end }}

{{/* The selector labels of the operator's pod. The LLMDeployments' own objects carry
app.kubernetes.io/name: iterserve too, with component server or router and managed-by
iterserve-operator: the operator's component (operator) keeps them apart. */}}
{{- define "iterserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "iterserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of every object the chart renders besides the selector's. */}}
{{- define "iterserve.commonLabels" -}}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of the operator and its plumbing. */}}
{{- define "iterserve.labels" -}}
{{ include "iterserve.selectorLabels" . }}
{{ include "iterserve.commonLabels" . }}
{{- end }}

{{/* The operator's image: image.repository@image.digest when a digest is set, else
image.repository:image.tag, the tag defaulting to <appVersion>-control. */}}
{{- define "iterserve.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default (printf "%s-control" .Chart.AppVersion)) }}
{{- end }}
{{- end }}

{{/* The routers' default image (--control-image): the operator's own unless set. */}}
{{- define "iterserve.controlImage" -}}
{{- .Values.operator.controlImage | default (include "iterserve.image" .) }}
{{- end }}

{{/* The example LLMDeployment's namespace. */}}
{{- define "iterserve.exampleNamespace" -}}
{{- .Values.example.namespace | default .Release.Namespace }}
{{- end }}

{{/* Labels of the objects an LLMDeployment's operator builds (iterserve/operator/builders.py
labels()), without the instance and component: the monitors select every LLMDeployment's. */}}
{{- define "iterserve.ownedSelector" -}}
app.kubernetes.io/name: iterserve
app.kubernetes.io/managed-by: iterserve-operator
{{- end }}

{{/* A monitor's scrape interval, refused above 60 s: the scale-to-zero wake trigger of an
LLMDeployment's KEDA ScaledObject takes rate() over 2m of the routers' requests, which needs
two samples in it, and the alerts' 5-minute windows want several. Arguments: root (the
chart's context) and monitor (serviceMonitor or podMonitor). */}}
{{- define "iterserve.scrapeInterval" -}}
{{- $interval := index .root.Values.metrics .monitor "interval" }}
{{- if gt (int64 (include "iterserve.durationMs" $interval)) 60000 }}
{{- fail (printf "metrics.%s.interval %s is longer than 60s: scale to zero wakes on rate() over 2m, which needs two scrapes in it (docs/observability.md)" .monitor $interval) }}
{{- end }}
{{- $interval }}
{{- end }}

{{/* Where the monitors look: every namespace, or the watched ones. */}}
{{- define "iterserve.monitorNamespaces" -}}
{{- if .Values.watchNamespaces }}
matchNames:
{{- range .Values.watchNamespaces }}
  - {{ . }}
{{- end }}
{{- else }}
any: true
{{- end }}
{{- end }}
