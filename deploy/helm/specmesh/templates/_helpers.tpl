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

{{/* A container given GPUs runs the CUDA image: the CPU image's torch has no CUDA. */}}
{{- define "specmesh.imageFor" -}}
{{- if gt (float64 .gpus) 0.0 -}}
{{ .root.Values.image.repository }}:{{ .root.Values.image.cudaTag | default (printf "%s-cuda" .root.Values.image.tag) }}
{{- else -}}
{{ include "specmesh.image" .root }}
{{- end -}}
{{- end -}}

{{- define "specmesh.redisSecret" -}}
{{- if .Values.redis.existingSecret -}}{{ .Values.redis.existingSecret }}{{- else -}}{{ include "specmesh.fullname" . }}-redis{{- end -}}
{{- end -}}

{{/* Redis URL without the password (SPECMESH_REDIS_PASSWORD carries it: nothing to escape);
     the bundled Redis is reached as the ACL user `specmesh` */}}
{{- define "specmesh.redisUrl" -}}
{{- if .Values.redis.bundled -}}
redis://specmesh@{{ include "specmesh.fullname" . }}-redis:6379/0
{{- else -}}
{{ .Values.redis.externalUrl }}
{{- end -}}
{{- end -}}

{{/* The bundled Redis's configuration, read from standard input (a here-document, the shell
     replaced by redis-server) so that the password is on no command line: one ACL user, `specmesh`, allowed only specmesh's keys and the command groups it
     uses (no admin or dangerous commands); the default user is off. */}}
{{/* The bundled Redis: only specmesh's keys; +@scripting because the correction memory writes
and joins through Lua scripts (services/memory/redis_memory.py), each one atomic */}}
{{- define "specmesh.redisCommand" -}}
- sh
- -c
- |
  exec redis-server - <<EOF
  user default off
  user specmesh on >$REDIS_PASSWORD ~specmesh:* &* +@read +@write +@stream +@scripting +@transaction +@connection -@dangerous
  appendonly yes
  EOF
{{- end -}}

{{- define "specmesh.internalAuth" -}}
{{- if and (eq .Values.mode "services") .Values.internalAuth.enabled }}true{{ end }}
{{- end -}}

{{- define "specmesh.securityEnv" -}}
{{- if include "specmesh.internalAuth" . }}
- {name: SPECMESH_INTERNAL_TOKEN_FILE, value: /etc/specmesh/internal/token}
{{- end }}
{{- if .Values.tls.enabled }}
- {name: SPECMESH_TLS_CERT, value: /etc/specmesh/tls/tls.crt}
- {name: SPECMESH_TLS_KEY, value: /etc/specmesh/tls/tls.key}
- {name: SPECMESH_TLS_CA, value: /etc/specmesh/tls/ca.crt}
{{- if .Values.tls.mutual }}
- {name: SPECMESH_TLS_CLIENT_CA, value: /etc/specmesh/tls/ca.crt}
- {name: SPECMESH_TLS_CLIENT_CERT, value: /etc/specmesh/tls/tls.crt}
- {name: SPECMESH_TLS_CLIENT_KEY, value: /etc/specmesh/tls/tls.key}
{{- end }}
{{- end }}
{{- end -}}

{{- define "specmesh.authEnv" -}}
{{- if .Values.auth.enabled }}
- name: SPECMESH_AUTH_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ required "auth.secretName is required when auth.enabled" .Values.auth.secretName }}, key: token}
# fail closed: an ingress that finds no token here refuses to serve (services/ray_app.py: api_token)
- {name: SPECMESH_AUTH_REQUIRED, value: "1"}
{{- end }}
{{- with .Values.auth.adminSecretName }}
- name: SPECMESH_ADMIN_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ . }}, key: token}
{{- end }}
{{- end -}}

{{- define "specmesh.mounts" -}}
- {name: tmp, mountPath: /tmp}
{{- if include "specmesh.internalAuth" . }}
- {name: internal-token, mountPath: /etc/specmesh/internal, readOnly: true}
{{- end }}
{{- if .Values.tls.enabled }}
- {name: tls, mountPath: /etc/specmesh/tls, readOnly: true}
{{- end }}
{{- if .Values.redis.caSecret }}
- {name: redis-ca, mountPath: /etc/specmesh/redis-ca, readOnly: true}
{{- end }}
{{- end -}}

{{- define "specmesh.volumes" -}}
- name: tmp
  emptyDir: {}
{{- if include "specmesh.internalAuth" . }}
- name: internal-token
  secret: {secretName: {{ include "specmesh.fullname" . }}-internal}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret: {secretName: {{ required "tls.secretName is required when tls.enabled" .Values.tls.secretName }}}
{{- end }}
{{- if .Values.redis.caSecret }}
- name: redis-ca
  secret: {secretName: {{ .Values.redis.caSecret }}}
{{- end }}
{{- end -}}

{{- define "specmesh.redisEnv" -}}
{{ include "specmesh.securityEnv" . }}
- name: SPECMESH_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specmesh.redisSecret" . }}
      key: password
- name: SPECMESH_REDIS_URL
  value: {{ include "specmesh.redisUrl" . | quote }}
{{- if .Values.redis.caSecret }}
- {name: SPECMESH_REDIS_CA, value: /etc/specmesh/redis-ca/ca.crt}
{{- end }}
{{- end -}}

{{- define "specmesh.modelArgs" -}}
- --target={{ .Values.models.dir }}/target
- --draft={{ .Values.models.dir }}/draft
- --eagle3={{ .Values.models.dir }}/{{ .Values.models.eagle3 }}
- --eagle3-k={{ .Values.models.eagle3K }}
- --eagle3-topk={{ .Values.models.eagle3Topk }}
- --eagle3-tree-tokens={{ .Values.models.eagle3TreeTokens }}
- --draft-vocab={{ .Values.models.draftVocab }}
- --predictor={{ .Values.models.dir }}/predictor
{{- with .Values.models.speculativeConfig }}
- --speculative-config={{ toJson . }}
{{- end }}
{{- end -}}

{{/* volumes + init container that make the models available at .Values.models.dir */}}
{{- define "specmesh.modelVolume" -}}
{{ include "specmesh.volumes" . }}
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
    # the image keeps its models outside the mount point: mounting the volume there would hide them
    command: ["sh", "-c", "cp -r /opt/specmesh-models/. {{ .Values.models.dir }}/"]
    securityContext: {{- toYaml .Values.securityContext | nindent 6 }}
    volumeMounts:
      - {name: models, mountPath: {{ .Values.models.dir }}}
{{- end }}
{{- end -}}

{{/* gRPC probes cannot speak TLS: TCP probes when TLS is on */}}
{{- define "specmesh.probes" -}}
{{- $check := ternary (dict "tcpSocket" (dict "port" .port)) (dict "grpc" (dict "port" .port)) .tls }}
startupProbe:  # the port opens once the models are loaded: liveness waits for it
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 5
  failureThreshold: {{ div .startup 5 }}
readinessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 5
livenessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 10
{{- end -}}

{{/* non-root, read-only root filesystem, no capabilities (values: podSecurityContext, securityContext) */}}
{{- define "specmesh.podSecurity" -}}
securityContext: {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- if not .kubeApi }}
serviceAccountName: {{ include "specmesh.fullname" . }}
automountServiceAccountToken: false
{{- end }}
{{- end -}}

{{/* A verifier replica's tensor-parallel size: verifier.tensorParallel, or 0 for verifier.gpus
(one rank per GPU; 1 on the CPU). On GPUs the two must agree: a rank takes one GPU. */}}
{{- define "specmesh.verifierTP" -}}
{{- $gpus := int .Values.verifier.gpus }}
{{- $tp := int .Values.verifier.tensorParallel }}
{{- if and (gt $gpus 0) (gt $tp 0) (ne $tp $gpus) }}
{{- fail (printf "verifier.tensorParallel: %d with verifier.gpus: %d: a replica's ranks take one GPU each; set tensorParallel to gpus (or 0, which follows gpus)" $tp $gpus) }}
{{- end }}
{{- if gt $tp 0 }}{{ $tp }}{{ else }}{{ max 1 $gpus }}{{ end }}
{{- end -}}
