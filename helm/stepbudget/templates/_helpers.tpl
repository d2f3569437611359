{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "stepbudget.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, or the release name when it already holds the chart name. */}}
{{- define "stepbudget.fullname" -}}
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

{{- define "stepbudget.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: never the chart version, so upgrades keep matching the pods. */}}
{{- define "stepbudget.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stepbudget.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stepbudget.labels" -}}
helm.sh/chart: {{ include "stepbudget.chart" . }}
{{ include "stepbudget.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stepbudget
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "stepbudget.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stepbudget.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "stepbudget.image" -}}
{{- $repository := .Values.image.repository }}
{{- if .Values.image.registry }}
{{- $repository = printf "%s/%s" .Values.image.registry .Values.image.repository }}
{{- end }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The daemon's config: values.config with `listen` set from .Values.port. */}}
{{- define "stepbudget.config" -}}
{{- $config := deepCopy .Values.config }}
{{- $_ := set $config "listen" (printf ":%d" (int .Values.port)) }}
{{- /* One runbook base for the rules the chart renders and the daemon's own alerts, unless the config names its own. */}}
{{- $runbook := .Values.prometheusRule.runbookBaseUrl }}
{{- if and $runbook (ne $runbook "https://github.com/stepbudget/stepbudget/blob/main/docs/runbook.md") }}
{{- $alerting := get $config "alerting" | default dict }}
{{- if not (get $alerting "runbook_base_url") }}
{{- $_ := set $alerting "runbook_base_url" $runbook }}
{{- $_ := set $config "alerting" $alerting }}
{{- end }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* Namespaces whose pods the config discovers through the Kubernetes API, one per line. */}}
{{- define "stepbudget.discoveryNamespaces" -}}
{{- $namespaces := list }}
{{- range .Values.config.deployments }}
{{- with (.targets | default dict).kubernetes }}
{{- $namespaces = append $namespaces (.namespace | default $.Release.Namespace) }}
{{- end }}
{{- end }}
{{- $namespaces | uniq | sortAlpha | join "\n" }}
{{- end }}

{{/* The pod template shared by the Deployment and the StatefulSet. */}}
{{- define "stepbudget.podTemplate" -}}
{{- $sharded := eq .Values.mode "statefulset" }}
{{- $discovers := ne (include "stepbudget.discoveryNamespaces" .) "" -}}
metadata:
  labels:
    {{- include "stepbudget.selectorLabels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "stepbudget.config" . | sha256sum }}
    {{- with .Values.models }}
    checksum/models: {{ toJson . | sha256sum }}
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "stepbudget.serviceAccountName" . }}
  # The Kubernetes API token is mounted only when the config discovers pods through it.
  automountServiceAccountToken: {{ $discovers }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  containers:
    - name: stepbudget
      image: {{ include "stepbudget.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - serve
        - --config
        - /etc/stepbudget/config.yaml
        {{- if $sharded }}
        - --shard
        - $(STEPBUDGET_SHARD_INDEX)/{{ .Values.replicas }}
        {{- end }}
        {{- with .Values.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if or $sharded .Values.extraEnv }}
      env:
        {{- if $sharded }}
        # The StatefulSet ordinal, from the label Kubernetes (>= 1.28) puts on every pod.
        - name: STEPBUDGET_SHARD_INDEX
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
        {{- end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      ports:
        - name: http
          containerPort: {{ .Values.port }}
          protocol: TCP
      livenessProbe:
        {{- toYaml .Values.livenessProbe | nindent 8 }}
      readinessProbe:
        {{- toYaml .Values.readinessProbe | nindent 8 }}
      resources:
        {{- toYaml .Values.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/stepbudget
          readOnly: true
        - name: tmp
          mountPath: /tmp
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "stepbudget.fullname" . }}
        {{- with .Values.models }}
        # The models' config.json files under /etc/stepbudget/models, where the daemon looks for a
        # model named by its Hugging Face id (a ConfigMap key cannot hold the id's `/`).
        items:
          - key: config.yaml
            path: config.yaml
          {{- range $id, $config := . }}
          - key: {{ include "stepbudget.modelConfigKey" $id }}
            path: models/{{ include "stepbudget.modelConfigKey" $id }}
          {{- end }}
        {{- end }}
    # The root filesystem is read-only; Python and libraries may still want a scratch /tmp.
    - name: tmp
      emptyDir:
        sizeLimit: 16Mi
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* The port of a URL: its explicit port, else 443 for https and 80 for http. */}}
{{- define "stepbudget.urlPort" -}}
{{- $url := urlParse (trim .) }}
{{- if regexMatch ":[0-9]+$" $url.host }}
{{- regexFind "[0-9]+$" $url.host }}
{{- else if eq $url.scheme "https" }}443
{{- else }}80
{{- end }}
{{- end }}

{{/* Every port the config's targets name (static URLs, dns.port, kubernetes.port with the
daemon's default 8000), plus networkPolicy.egress.modelServers.extraPorts, one per line. */}}
{{- define "stepbudget.modelServerPorts" -}}
{{- $ports := list }}
{{- range .Values.config.deployments }}
{{- $targets := .targets | default dict }}
{{- $static := $targets.static | default list }}
{{- if kindIs "string" $static }}{{ $static = list $static }}{{ end }}
{{- range $static }}
{{- $ports = append $ports (include "stepbudget.urlPort" .) }}
{{- end }}
{{- with $targets.dns }}
{{- $ports = append $ports (toString (.port | default 8000)) }}
{{- end }}
{{- with $targets.kubernetes }}
{{- $ports = append $ports (toString (.port | default 8000)) }}
{{- end }}
{{- end }}
{{- range .Values.networkPolicy.egress.modelServers.extraPorts }}
{{- $ports = append $ports (toString .) }}
{{- end }}
{{- $ports | uniq | sortAlpha | join "\n" }}
{{- end }}

{{/* The ports of the Prometheus query APIs the config reads, one per line: Prometheus mode
(deployments[].targets.prometheus.url) and online calibration's seeding (online_calibration.prometheus_url
under defaults or a deployment). */}}
{{- define "stepbudget.prometheusPorts" -}}
{{- $ports := list }}
{{- $config := .Values.config | default dict }}
{{- with ($config.defaults | default dict).online_calibration }}
{{- with .prometheus_url }}{{ $ports = append $ports (include "stepbudget.urlPort" .) }}{{ end }}
{{- end }}
{{- range $config.deployments }}
{{- with (.targets | default dict).prometheus }}
{{- with .url }}{{ $ports = append $ports (include "stepbudget.urlPort" .) }}{{ end }}
{{- end }}
{{- with .online_calibration }}
{{- with .prometheus_url }}{{ $ports = append $ports (include "stepbudget.urlPort" .) }}{{ end }}
{{- end }}
{{- end }}
{{- $ports | uniq | sortAlpha | join "\n" }}
{{- end }}

{{/* The ports of alerting.alertmanager_urls, one per line. */}}
{{- define "stepbudget.alertmanagerPorts" -}}
{{- $ports := list }}
{{- $urls := (.Values.config.alerting | default dict).alertmanager_urls | default list }}
{{- if kindIs "string" $urls }}{{ $urls = list $urls }}{{ end }}
{{- range $urls }}
{{- $ports = append $ports (include "stepbudget.urlPort" .) }}
{{- end }}
{{- $ports | uniq | sortAlpha | join "\n" }}
{{- end }}

{{/* The file (and ConfigMap key) a model's config.json is kept under: `Qwen/Qwen3-8B` -> `Qwen--Qwen3-8B.json`,
as exporter/capacity/model_files.py looks for it. */}}
{{- define "stepbudget.modelConfigKey" -}}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$" .) -}}
{{- fail (printf "models: %q is not a Hugging Face id (owner/name), the form `model:` takes it in the config" .) -}}
{{- end -}}
{{- replace "/" "--" . }}.json
{{- end }}
