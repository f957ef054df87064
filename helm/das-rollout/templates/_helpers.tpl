{{/*
Names and labels. The fullname is truncated to 50 characters because KubeRay derives longer names from the
RayCluster's (<name>-head-svc, <name>-<group>-worker-<hash>) and Kubernetes caps names at 63.
*/}}
{{- define "das-rollout.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" }}
{{- end }}

{{- define "das-rollout.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "das-rollout.selectorLabels" -}}
app.kubernetes.io/name: {{ include "das-rollout.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "das-rollout.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "das-rollout.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "das-rollout.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The Secret holding the API token: the user's existing one, or the one this chart creates. */}}
{{- define "das-rollout.tokenSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-token" (include "das-rollout.fullname" .)) }}
{{- end }}

{{/* The claim holding the history state directory: the user's existing one, or the one this chart creates. */}}
{{- define "das-rollout.historyClaimName" -}}
{{- .Values.history.persistence.existingClaim | default (printf "%s-history" (include "das-rollout.fullname" .)) }}
{{- end }}

{{/*
One shell word: the value in single quotes, each ' inside written as '\''. The head's command line goes through
bash (it starts Ray first), so every value from the user is quoted here rather than trusted.
*/}}
{{- define "das-rollout.shellQuote" -}}
{{- printf "'%s'" (replace "'" "'\\''" (toString .)) }}
{{- end }}

{{/* `das serve` on the head, attached to the Ray node started just before (--address auto). */}}
{{- define "das-rollout.serveCommand" -}}
{{- $v := .Values -}}
{{- $args := list "das" "serve" "--address" "auto" "--host" "0.0.0.0" "--port" (toString $v.gateway.port) -}}
{{- $args = concat $args (list "--header-timeout" (toString $v.gateway.headerTimeoutSeconds)) -}}
{{- $args = concat $args (list "--body-timeout" (toString $v.gateway.bodyTimeoutSeconds)) -}}
{{- if $v.gateway.otlpTracesEndpoint }}
{{- $args = concat $args (list "--otlp-traces-endpoint" (include "das-rollout.shellQuote" $v.gateway.otlpTracesEndpoint)) -}}
{{- end }}
{{- $args = concat $args (list "--model" (include "das-rollout.shellQuote" $v.engine.model)) -}}
{{- $args = concat $args (list "--speculation" (include "das-rollout.shellQuote" $v.engine.speculation)) -}}
{{- $args = concat $args (list "--k" (toString (int $v.engine.k))) -}}
{{- $args = concat $args (list "--dtype" (include "das-rollout.shellQuote" $v.engine.dtype)) -}}
{{- $args = concat $args (list "--tensor-parallel-size" (toString (int $v.engine.tensorParallelSize))) -}}
{{- if $v.engine.maxModelLen }}
{{- $args = concat $args (list "--max-model-len" (toString (int $v.engine.maxModelLen))) -}}
{{- end }}
{{- if $v.engine.eager }}
{{- $args = append $args "--eager" -}}
{{- end }}
{{- $args = concat $args (list "--budget" (include "das-rollout.shellQuote" $v.engine.budget)) -}}
{{- $args = concat $args (list "--max-restarts" (toString (int $v.engine.maxRestarts))) -}}
{{- $args = concat $args (list "--restart-window" (toString $v.engine.restartWindowSeconds)) -}}
{{- $args = concat $args (list "--max-group-deaths" (toString (int $v.engine.maxGroupDeaths))) -}}
{{- $args = concat $args (list "--weight-transfer" (include "das-rollout.shellQuote" $v.engine.weightTransfer)) -}}
{{- $args = concat $args (list "--state-dir" (include "das-rollout.shellQuote" $v.history.mountPath)) -}}
{{- $args = concat $args (list "--snapshot-interval" (toString $v.history.snapshotIntervalSeconds)) -}}
{{- if $v.weights.volume }}
{{- $args = concat $args (list "--weights-root" (include "das-rollout.shellQuote" $v.weights.mountPath)) -}}
{{- end }}
{{- if and $v.autoscaling.enabled $v.autoscaling.targetEngines }}
{{- $args = concat $args (list "--target-engines" (toString (int $v.autoscaling.targetEngines))) -}}
{{- end }}
{{- range $v.engine.extraArgs }}
{{- $args = append $args (include "das-rollout.shellQuote" .) -}}
{{- end }}
{{- join " " $args }}
{{- end }}

{{/* Volumes every Ray node mounts: /dev/shm in memory (Ray's object store and NCCL use it) and the weights. */}}
{{- define "das-rollout.commonVolumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- if .root.Values.weights.volume }}
- name: weights
  {{- toYaml .root.Values.weights.volume | nindent 2 }}
{{- end }}
{{- end }}

{{- define "das-rollout.commonVolumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if .Values.weights.volume }}
- name: weights
  mountPath: {{ .Values.weights.mountPath }}
  readOnly: {{ .Values.weights.readOnly }}
{{- end }}
{{- end }}
