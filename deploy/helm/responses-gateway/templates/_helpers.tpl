{{- define "rg.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rg.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "rg.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "rg.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rg.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rg.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "rg.labels" -}}
{{ include "rg.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rg.validateMode" -}}
{{- if not (has .Values.mode (list "sidecar" "standalone")) -}}
{{- fail (printf "mode must be sidecar or standalone, got %q" .Values.mode) -}}
{{- end -}}
{{- end -}}

{{- define "rg.upstreamUrl" -}}
{{- if .Values.gateway.upstreamUrl -}}{{ .Values.gateway.upstreamUrl }}
{{- else if eq .Values.mode "sidecar" -}}http://127.0.0.1:8000
{{- else -}}{{ .Values.standalone.upstreamUrl }}
{{- end -}}
{{- end -}}

{{- define "rg.restrictedSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}
