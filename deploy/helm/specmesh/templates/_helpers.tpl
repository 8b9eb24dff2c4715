{{- define "specmesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "specmesh.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "specmesh.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "specmesh.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "specmesh.redisSecret" -}}
{{- if .Values.redis.existingSecret -}}{{ .Values.redis.existingSecret }}{{- else -}}{{ include "specmesh.fullname" . }}-redis{{- end -}}
{{- end -}}

{{/* redis URL with $(REDIS_PASSWORD) expanded by Kubernetes from the env var */}}
{{- define "specmesh.redisUrl" -}}
{{- if .Values.redis.bundled -}}
redis://:$(REDIS_PASSWORD)@{{ include "specmesh.fullname" . }}-redis:6379/0
{{- else -}}
{{- $u := urlParse .Values.redis.externalUrl -}}
{{ $u.scheme }}://:$(REDIS_PASSWORD)@{{ $u.host }}{{ $u.path }}
{{- end -}}
{{- end -}}

{{- define "specmesh.redisEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specmesh.redisSecret" . }}
      key: password
- name: SPECMESH_REDIS_URL
  value: {{ include "specmesh.redisUrl" . | quote }}
{{- end -}}

{{- define "specmesh.modelArgs" -}}
- --target={{ .Values.models.dir }}/target
- --draft={{ .Values.models.dir }}/draft
- --eagle3={{ .Values.models.dir }}/eagle3
- --predictor={{ .Values.models.dir }}/predictor
{{- end -}}

{{/* volumes + init container that make the models available at .Values.models.dir */}}
{{- define "specmesh.modelVolume" -}}
- name: models
{{- if eq .Values.models.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.pvc.existingClaim | default (printf "%s-models" (include "specmesh.fullname" .)) }}
    readOnly: true
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "specmesh.modelInit" -}}
{{- if eq .Values.models.source "image" }}
initContainers:
  - name: models
    image: {{ .Values.models.image }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["sh", "-c", "cp -r /models/. {{ .Values.models.dir }}/"]
    volumeMounts:
      - {name: models, mountPath: {{ .Values.models.dir }}}
{{- end }}
{{- end -}}

{{- define "specmesh.probes" -}}
readinessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 5
livenessProbe:
  grpc: {port: {{ .port }}}
  initialDelaySeconds: 30
  periodSeconds: 10
{{- end -}}
