{{/* Chart name, truncated to the DNS label limit. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified base name for every resource. */}}
{{- define "tandem.fullname" -}}
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

{{/* Name of one component's resources: <fullname>-<component>. */}}
{{- define "tandem.componentName" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{/* Labels that select one component's pods. */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Full image reference of one component. */}}
{{- define "tandem.image" -}}
{{- $ref := printf "%s/%s:%s" .root.Values.image.registry .image.repository (default .root.Chart.AppVersion .root.Values.image.tag) }}
{{- with .image.digest }}{{ $ref = printf "%s@%s" $ref . }}{{ end }}
{{- $ref }}
{{- end }}

{{/* The Secret holding the cloud token, and its key. */}}
{{- define "tandem.cloudSecretName" -}}
{{- if .Values.cloud.existingSecret }}
{{- .Values.cloud.existingSecret }}
{{- else }}
{{- include "tandem.componentName" (dict "root" . "component" "cloud") }}
{{- end }}
{{- end }}

{{- define "tandem.cloudSecretKey" -}}
{{- if .Values.cloud.existingSecret }}{{ .Values.cloud.existingSecretKey }}{{ else }}token{{ end }}
{{- end }}

{{/* The cloud API URL: explicit, or the bundled mock's Service when cloud.urls names no
     edges either; empty when cloud.urls alone names them. */}}
{{- define "tandem.cloudURL" -}}
{{- if .Values.cloud.url }}
{{- .Values.cloud.url }}
{{- else if .Values.cloud.urls }}
{{- else if .Values.cloudMock.enabled }}
{{- printf "http://%s.%s.svc:%d" (include "tandem.componentName" (dict "root" . "component" "cloud-mock")) .Release.Namespace (int .Values.cloudMock.port) }}
{{- else }}
{{- fail "cloud.url (or cloud.urls) is required unless cloudMock.enabled is true" }}
{{- end }}
{{- end }}

{{/* Every edge the controller may call, in the order it tries them: the URL above, then
     cloud.urls. */}}
{{- define "tandem.cloudEdges" -}}
{{- $url := include "tandem.cloudURL" . }}
{{- join ", " (compact (prepend .Values.cloud.urls $url)) }}
{{- end }}

{{/* Container security context shared by the unprivileged components. */}}
{{- define "tandem.restrictedContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: ["ALL"]
seccompProfile:
  {{- include "tandem.seccompProfile" . | nindent 2 }}
{{- end }}

{{/* The seccomp profile of every pod and container (value seccompProfile). */}}
{{- define "tandem.seccompProfile" -}}
type: {{ .Values.seccompProfile.type }}
{{- if eq .Values.seccompProfile.type "Localhost" }}
localhostProfile: {{ required "seccompProfile.localhostProfile is required when seccompProfile.type is Localhost" .Values.seccompProfile.localhostProfile | quote }}
{{- end }}
{{- end }}

{{/* The API server's address, for components that must not reach it through the
     `kubernetes` Service: the node proxy programs that Service's ClusterIP itself. The
     Kubernetes clients read these two variables (as client-go's in-cluster config does). */}}
{{- define "tandem.apiServerEnv" -}}
{{- if .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ .Values.apiServer.host | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ .Values.apiServer.port | quote }}
{{- end }}
{{- end }}

{{/* The controller's provider (`--cloud-provider`): `default` keeps a release upgraded
     with --reuse-values from a chart without the value working. */}}
{{- define "tandem.cloudProvider" -}}
{{- default "mockcloud" .Values.cloud.provider }}
{{- end }}

{{/* Each provider's own default spec.loadBalancerClass (its Profile in the controller),
     what the controller implements when loadBalancerClass is empty. */}}
{{- define "tandem.loadBalancerClass" -}}
{{- $defaults := dict "mockcloud" "tandem.io/mockcloud" }}
{{- default (get $defaults (include "tandem.cloudProvider" .)) .Values.loadBalancerClass }}
{{- end }}

{{/* Where the controller's pods mount the cloud's token, CA and configuration (the
     bundled mock its token too). Whole directories, never subPath: the kubelet updates a
     mounted Secret only then, which is how a rotated token reaches both without a
     restart. */}}
{{- define "tandem.cloudTokenDir" -}}/etc/tandem/cloud{{- end }}
{{- define "tandem.cloudCADir" -}}/etc/tandem/cloud-ca{{- end }}
{{- define "tandem.cloudClientDir" -}}/etc/tandem/cloud-client{{- end }}
{{- define "tandem.cloudConfigFile" -}}/etc/tandem/cloud-config/cloud-config.json{{- end }}

{{/* The provider's configuration file (`--cloud-config`), in the mockcloud provider's
     format (controller/mockcloud/src/config.rs): the edge's URL and, with cloud.urls, the
     other edges of its API, the token file, with cloud.caSecret the CA that signed the
     edges' certificates, and with cloud.clientCertSecret the controller's own certificate
     and key (mutual TLS). */}}
{{- define "tandem.cloudConfig" -}}
{{- $config := dict "tokenFile" (printf "%s/%s" (include "tandem.cloudTokenDir" .) (include "tandem.cloudSecretKey" .)) }}
{{- with include "tandem.cloudURL" . }}
{{- $_ := set $config "url" . }}
{{- end }}
{{- with .Values.cloud.urls }}
{{- $_ := set $config "urls" . }}
{{- end }}
{{- if .Values.cloud.caSecret }}
{{- $_ := set $config "caFile" (printf "%s/ca.crt" (include "tandem.cloudCADir" .)) }}
{{- end }}
{{- if .Values.cloud.clientCertSecret }}
{{- $_ := set $config "clientCertFile" (printf "%s/tls.crt" (include "tandem.cloudClientDir" .)) }}
{{- $_ := set $config "clientKeyFile" (printf "%s/tls.key" (include "tandem.cloudClientDir" .)) }}
{{- end }}
{{- toPrettyJson $config }}
{{- end }}

{{/* The controller's pods' volumes and mounts for the cloud: the configuration, the
     token, the CA and the client certificate. */}}
{{- define "tandem.cloudVolumeMounts" -}}
- name: cloud-config
  mountPath: {{ include "tandem.cloudConfigFile" . | dir }}
  readOnly: true
- name: cloud-token
  mountPath: {{ include "tandem.cloudTokenDir" . }}
  readOnly: true
{{- if .Values.cloud.caSecret }}
- name: cloud-ca
  mountPath: {{ include "tandem.cloudCADir" . }}
  readOnly: true
{{- end }}
{{- if .Values.cloud.clientCertSecret }}
- name: cloud-client-cert
  mountPath: {{ include "tandem.cloudClientDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "tandem.cloudVolumes" -}}
- name: cloud-config
  configMap:
    name: {{ include "tandem.componentName" (dict "root" . "component" "cloud-config") }}
- name: cloud-token
  secret:
    secretName: {{ include "tandem.cloudSecretName" . }}
    defaultMode: 0400
{{- with .Values.cloud.caSecret }}
- name: cloud-ca
  secret:
    secretName: {{ . }}
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- with .Values.cloud.clientCertSecret }}
- name: cloud-client-cert
  secret:
    secretName: {{ . }}
    defaultMode: 0400
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- end }}

{{/* The controller's cluster facts, shared by its Deployment and the uninstall hook. */}}
{{- define "tandem.controllerArgs" -}}
- --cloud-provider={{ include "tandem.cloudProvider" . }}
- --cloud-config={{ include "tandem.cloudConfigFile" . }}
- --cluster-id={{ .Values.clusterId }}
{{- with .Values.loadBalancerClass }}
- --load-balancer-class={{ . }}
{{- end }}
- --claim-unclassed={{ .Values.claimUnclassed }}
{{- if .Values.controller.leaderElection }}
- --leader-elect
- --leader-elect-namespace={{ .Release.Namespace }}
- --leader-elect-lease-name={{ include "tandem.componentName" (dict "root" . "component" "controller") }}
{{- end }}
- --log-format={{ .Values.log.format }}
{{- end }}
