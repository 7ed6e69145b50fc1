{{/*
Names. fullname is `<release>-fp8rl` (or `<release>-<nameOverride>`, or fullnameOverride): fixed
rather than deduplicated, so other tools can derive the names from the release alone.
*/}}
{{- define "fp8rl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fp8rl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "fp8rl.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
The RayJob defaults ConfigMap: `<release>-fp8rl-rayjob-defaults`, whatever the overrides, because
the RL-step component computes this name from the release name.
*/}}
{{- define "fp8rl.rayjobDefaultsName" -}}
{{- printf "%s-fp8rl-rayjob-defaults" .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fp8rl.rayClusterName" -}}
{{- printf "%s-ray" (include "fp8rl.fullname" .) | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/* KubeRay names the head Service of a RayCluster `<cluster>-head-svc`. */}}
{{- define "fp8rl.rayHeadService" -}}
{{- printf "%s-head-svc" (include "fp8rl.rayClusterName" .) }}
{{- end }}

{{- define "fp8rl.dataClaimName" -}}
{{- .Values.storage.existingClaim | default (printf "%s-data" (include "fp8rl.fullname" .)) }}
{{- end }}

{{- define "fp8rl.mlflowName" -}}
{{- printf "%s-mlflow" (include "fp8rl.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "fp8rl.mlflowClaimName" -}}
{{- .Values.mlflow.persistence.existingClaim | default (include "fp8rl.mlflowName" .) }}
{{- end }}

{{/* The MLflow PVC holds the SQLite store, the artifacts and the auth database: needed if any is used. */}}
{{- define "fp8rl.mlflowNeedsVolume" -}}
{{- if or (eq .Values.mlflow.backend.type "sqlite") (eq .Values.mlflow.artifacts.type "pvc") .Values.mlflow.auth.enabled }}true{{ end }}
{{- end }}

{{- define "fp8rl.mlflowAuthSecretName" -}}
{{- .Values.mlflow.auth.existingSecret | default (printf "%s-auth" (include "fp8rl.mlflowName" .)) }}
{{- end }}

{{/* The non-admin MLflow user's Secret (keys username, password), the pipeline steps' mlflow_secret. */}}
{{- define "fp8rl.mlflowClientSecretName" -}}
{{- include "fp8rl.fullname" . }}-mlflow-client
{{- end }}

{{- define "fp8rl.mlflowServiceHost" -}}
{{- printf "%s.%s.svc.%s" (include "fp8rl.mlflowName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* The tracking URI RayJobs get: the chart's server, or an external one, or "". */}}
{{- define "fp8rl.mlflowTrackingUri" -}}
{{- if .Values.mlflow.enabled }}
{{- printf "http://%s:%d" (include "fp8rl.mlflowServiceHost" .) (int .Values.mlflow.service.port) }}
{{- else }}
{{- .Values.mlflow.externalTrackingUri }}
{{- end }}
{{- end }}

{{- define "fp8rl.rayTokenSecretName" -}}
{{- .Values.ray.auth.existingSecret | default (printf "%s-ray-token" (include "fp8rl.fullname" .)) }}
{{- end }}

{{- define "fp8rl.pipelineServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- printf "%s-pipeline" (include "fp8rl.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- required "serviceAccount.pipelineName is required when serviceAccount.create is false" .Values.serviceAccount.pipelineName }}
{{- end }}
{{- end }}

{{- define "fp8rl.rayServiceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- printf "%s-ray" (include "fp8rl.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- required "serviceAccount.rayName is required when serviceAccount.create is false" .Values.serviceAccount.rayName }}
{{- end }}
{{- end }}

{{/* Labels. */}}
{{- define "fp8rl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fp8rl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "fp8rl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "fp8rl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fp8rl
{{- end }}

{{/* Images: `[registry/]repository@digest` when a digest is set, else `[registry/]repository:tag`, the tag
defaulting to the chart's appVersion. */}}
{{- define "fp8rl.image" -}}
{{- $root := index . 0 }}{{- $image := index . 1 }}
{{- $repo := $image.repository }}
{{- if $root.Values.images.registry }}{{- $repo = printf "%s/%s" (trimSuffix "/" $root.Values.images.registry) $repo }}{{- end }}
{{- if $image.digest }}
{{- printf "%s@%s" $repo $image.digest }}
{{- else }}
{{- printf "%s:%s" $repo ($image.tag | default $root.Chart.AppVersion) }}
{{- end }}
{{- end }}

{{- define "fp8rl.runtimeImage" -}}
{{- include "fp8rl.image" (list . .Values.images.runtime) }}
{{- end }}

{{- define "fp8rl.componentImage" -}}
{{- include "fp8rl.image" (list . .Values.images.component) }}
{{- end }}

{{- define "fp8rl.mlflowImage" -}}
{{- if .Values.mlflow.image.repository }}
{{- include "fp8rl.image" (list . (dict "repository" .Values.mlflow.image.repository "tag" (.Values.mlflow.image.tag | default .Values.images.component.tag) "digest" .Values.mlflow.image.digest)) }}
{{- else }}
{{- include "fp8rl.componentImage" . }}
{{- end }}
{{- end }}

{{/* `imagePullSecrets:` at the given indent, or nothing: `{{- include "fp8rl.imagePullSecrets" (list . 6) }}`. */}}
{{- define "fp8rl.imagePullSecrets" -}}
{{- $root := index . 0 }}{{- $indent := index . 1 }}
{{- with $root.Values.images.pullSecrets }}
{{- printf "imagePullSecrets:\n%s" (toYaml . | indent 2) | nindent $indent }}
{{- end }}
{{- end }}

{{/* Container security context: the global one with a component's overrides merged in. */}}
{{- define "fp8rl.containerSecurityContext" -}}
{{- $root := index . 0 }}{{- $overrides := index . 1 }}
{{- toYaml (mergeOverwrite (deepCopy $root.Values.containerSecurityContext) (deepCopy ($overrides | default dict))) }}
{{- end }}

{{/* Resources with `nvidia.com/gpu: N` added to requests and limits (N = 0: unchanged). */}}
{{- define "fp8rl.gpuResources" -}}
{{- $resources := deepCopy (index . 0) }}{{- $gpus := int (index . 1) }}
{{- if gt $gpus 0 }}
{{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" $gpus) ($resources.requests | default dict)) }}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $gpus) ($resources.limits | default dict)) }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* Environment of every Ray container. */}}
{{- define "fp8rl.rayEnv" -}}
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /data/huggingface
{{- with (include "fp8rl.mlflowTrackingUri" .) }}
- name: MLFLOW_TRACKING_URI
  value: {{ . | quote }}
{{- end }}
{{- if and .Values.mlflow.enabled .Values.mlflow.auth.enabled }}
- name: MLFLOW_TRACKING_USERNAME
  value: {{ .Values.mlflow.auth.clientUsername | quote }}
- name: MLFLOW_TRACKING_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "fp8rl.mlflowClientSecretName" . }}
      key: password
{{- end }}
{{- with .Values.ray.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes of every Ray pod: /dev/shm sized for the object store, /tmp (read-only root), /data. */}}
{{- define "fp8rl.rayVolumes" -}}
{{- $root := index . 0 }}{{- $shm := index . 1 -}}
- name: shared-mem
  emptyDir:
    medium: Memory
    sizeLimit: {{ $shm }}
- name: tmp
  emptyDir: {}
- name: data
  persistentVolumeClaim:
    claimName: {{ include "fp8rl.dataClaimName" $root }}
{{- end }}

{{- define "fp8rl.rayVolumeMounts" -}}
- name: shared-mem
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
- name: data
  mountPath: /data
{{- end }}

{{/* Generated secret values that survive upgrades: the existing Secret's value if there is one. */}}
{{- define "fp8rl.persistentRandom" -}}
{{- $root := index . 0 }}{{- $name := index . 1 }}{{- $key := index . 2 }}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace $name }}
{{- if and $existing (hasKey ($existing.data | default dict) $key) }}
{{- index $existing.data $key }}
{{- else }}
{{- randAlphaNum 48 | b64enc }}
{{- end }}
{{- end }}
