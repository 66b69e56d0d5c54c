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

{{/* The operator's image: image.repository:image.tag, the tag defaulting to <appVersion>-control. */}}
{{- define "iterserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default (printf "%s-control" .Chart.AppVersion)) }}
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
