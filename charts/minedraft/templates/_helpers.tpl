{{/* Names, labels and the pieces every pod shares. */}}

{{- define "minedraft.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-wide prefix; component names add at most "-scheduler" (10 chars), so keep 52. */}}
{{- define "minedraft.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "minedraft.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "verifier"). */}}
{{- define "minedraft.selectorLabels" -}}
app.kubernetes.io/name: {{ include "minedraft.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "minedraft.labels" -}}
helm.sh/chart: {{ include "minedraft.chart" .root }}
{{ include "minedraft.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: minedraft
{{- end }}

{{- define "minedraft.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "minedraft.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "minedraft.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* "true" when a speculative config is set (then a drafter is deployed), "" otherwise. */}}
{{- define "minedraft.speculative" -}}
{{- if .Values.speculativeConfig }}true{{ end }}
{{- end }}

{{/* "true" when the drafter drafts without a model (method ngram or suffix): it takes no GPU and loads nothing. */}}
{{- define "minedraft.lookup" -}}
{{- if and .Values.speculativeConfig (has (default "draft_model" .Values.speculativeConfig.method) (list "ngram" "suffix")) }}true{{ end }}
{{- end }}

{{/* "true" when a drafter pool drafts for the engine groups (drafterPool.replicas >= 1, with speculation): then
     no group has a drafter of its own, and each scheduler finds the pool's members through its headless Service. */}}
{{- define "minedraft.pool" -}}
{{- if and (include "minedraft.speculative" .) (ge (int .Values.drafterPool.replicas) 1) }}true{{ end }}
{{- end }}

{{/* The pool's resource name: "-drafter-pool" is 13 characters, so the prefix is cut to 50 (a Service name is
     a DNS label of at most 63). */}}
{{- define "minedraft.poolName" -}}
{{- printf "%s-drafter-pool" (include "minedraft.fullname" . | trunc 50 | trimSuffix "-") }}
{{- end }}

{{/* What a scheduler of a pool is given (MINEDRAFT_DRAFTER_POOL): the headless Service, each of whose addresses
     is one member. */}}
{{- define "minedraft.drafterPoolAddress" -}}
{{- printf "%s.%s.svc:%d" (include "minedraft.poolName" .) .Release.Namespace (int .Values.drafterPool.port) }}
{{- end }}

{{- define "minedraft.gpu" -}}
{{- if ne .Values.engine.device "cpu" }}true{{ end }}
{{- end }}

{{/* Service DNS names, namespace-qualified so they also resolve from other namespaces. */}}
{{- define "minedraft.verifierHost" -}}
{{- printf "%s-verifier.%s.svc" (include "minedraft.fullname" .) .Release.Namespace }}
{{- end }}

{{- define "minedraft.drafterHost" -}}
{{- printf "%s-drafter.%s.svc" (include "minedraft.fullname" .) .Release.Namespace }}
{{- end }}

{{- define "minedraft.startupBudgetSeconds" -}}
{{- mul (int .Values.probes.startup.periodSeconds) (int .Values.probes.startup.failureThreshold) }}
{{- end }}

{{- define "minedraft.claimName" -}}
{{- if eq .Values.models.volume.type "existingClaim" }}
{{- .Values.models.volume.existingClaim }}
{{- else }}
{{- printf "%s-models" (include "minedraft.fullname" .) }}
{{- end }}
{{- end }}

{{/*
Cross-field checks the JSON schema cannot phrase clearly; each fails the install with what to change.
*/}}
{{- define "minedraft.validate" -}}
{{- $m := .Values.models }}
{{- if and (include "minedraft.gpu" .) (not $m.allowBundledOnGpus) }}
{{- if not $m.target }}
{{- fail (printf "no model named: models.target is empty, so the verifier would load the bundled development pair (a model of a few MB) onto %d GPUs and the drafter onto 1. Name your checkpoints: models.target and models.draft on a model volume (models.download fetches Hub ids into it), or use -f values-cpu.yaml for the CPU profile (models.allowBundledOnGpus=true renders it on GPUs anyway, as a smoke test)" (int .Values.verifier.tensorParallelSize)) }}
{{- end }}
{{- if and (include "minedraft.speculative" .) (not (include "minedraft.lookup" .)) (not $m.draft) (not (.Values.speculativeConfig).model) }}
{{- fail "no draft named: models.draft is empty, so the drafter would load the bundled development draft beside your target. Name the draft (models.draft on the model volume, or speculativeConfig.model), or set speculativeConfig: null for plain decoding" }}
{{- end }}
{{- end }}
{{- $usesVolume := or $m.target $m.draft }}
{{- if and $usesVolume (eq $m.volume.type "none") }}
{{- fail "models.target/models.draft name folders on the model volume: set models.volume.type to existingClaim, createClaim or emptyDir (or leave both empty for the bundled models)" }}
{{- end }}
{{- if and (eq $m.volume.type "existingClaim") (not $m.volume.existingClaim) }}
{{- fail "models.volume.type=existingClaim needs models.volume.existingClaim (the PersistentVolumeClaim's name)" }}
{{- end }}
{{- if eq $m.volume.type "emptyDir" }}
{{- if or (and $m.target (not (and $m.download.enabled $m.download.target))) (and $m.draft (not (and $m.download.enabled $m.download.draft))) }}
{{- fail "models.volume.type=emptyDir starts empty: enable models.download with a repository for each of models.target/models.draft, or use existingClaim/createClaim" }}
{{- end }}
{{- end }}
{{- if $m.download.enabled }}
{{- if eq $m.volume.type "none" }}
{{- fail "models.download needs a model volume: set models.volume.type to existingClaim, createClaim or emptyDir" }}
{{- end }}
{{- if not (or $m.download.target $m.download.draft) }}
{{- fail "models.download.enabled needs models.download.target and/or models.download.draft (Hub repository ids)" }}
{{- end }}
{{- if and $m.download.target (not $m.target) }}
{{- fail "models.download.target needs models.target: the folder (under models.mountPath) to download it into" }}
{{- end }}
{{- if and $m.download.draft (not $m.draft) }}
{{- fail "models.download.draft needs models.draft: the folder (under models.mountPath) to download it into" }}
{{- end }}
{{- end }}
{{- with .Values.speculativeConfig }}
{{- if and .force_pearl (not .is_parallel) }}
{{- fail "speculativeConfig.force_pearl requires speculativeConfig.is_parallel: true" }}
{{- end }}
{{- if and .model $m.draft }}
{{- fail "set either models.draft (a folder on the model volume) or speculativeConfig.model (a path in the image), not both" }}
{{- end }}
{{- if and (include "minedraft.lookup" $) $m.draft }}
{{- fail (printf "speculativeConfig.method %s drafts without a model: leave models.draft empty" .method) }}
{{- end }}
{{- end }}
{{- $tls := .Values.tls }}
{{- if and $tls.existingSecret $tls.certManager.enabled }}
{{- fail "set either tls.existingSecret or tls.certManager.enabled, not both" }}
{{- end }}
{{- if and $tls.certManager.enabled (not $tls.certManager.issuerRef.name) }}
{{- fail "tls.certManager.enabled needs tls.certManager.issuerRef.name (an existing Issuer or ClusterIssuer)" }}
{{- end }}
{{- if and (include "minedraft.tlsSecret" .) (not .Values.scheduler.httpPort) }}
{{- fail "TLS needs scheduler.httpPort: the scheduler's probes check /health over HTTPS (Kubernetes' gRPC probes cannot use TLS)" }}
{{- end }}
{{- if and (include "minedraft.tlsSecret" .) .Values.gateway.enabled (not .Values.gateway.httpPort) }}
{{- fail "TLS needs gateway.httpPort: the gateway's probes check /health over HTTPS (Kubernetes' gRPC probes cannot use TLS)" }}
{{- end }}
{{- if and .Values.apiKeys.existingSecret .Values.gateway.enabled (not .Values.apiKeys.gatewayKey) }}
{{- fail "apiKeys.existingSecret with the gateway on needs apiKeys.gatewayKey: the key (in that Secret) of the gateway's own API key toward the schedulers" }}
{{- end }}
{{- if and $m.draft (not (include "minedraft.speculative" .)) }}
{{- fail "models.draft is set but speculativeConfig is null: without speculation there is no drafter" }}
{{- end }}
{{- include "minedraft.validateLora" . }}
{{- include "minedraft.validatePool" . }}
{{- end }}

{{/* What a drafter pool cannot do, and the sizes it needs; every message names drafterPool. */}}
{{- define "minedraft.validatePool" -}}
{{- $p := .Values.drafterPool }}
{{- if ge (int $p.replicas) 1 }}
{{- if not (include "minedraft.speculative" .) }}
{{- fail (printf "drafterPool.replicas is %d but speculativeConfig is null: without speculation nothing is drafted; set drafterPool.replicas: 0" (int $p.replicas)) }}
{{- end }}
{{- $method := default "draft_model" .Values.speculativeConfig.method }}
{{- if has $method (list "eagle" "eagle3") }}
{{- fail (printf "drafterPool cannot serve speculativeConfig.method %s: an EAGLE head reads the target's hidden states every step, and a pool member is reached over the network, so keep a drafter beside each verifier (drafterPool.replicas: 0) or draft with method draft_model, ngram or suffix" $method) }}
{{- end }}
{{- $e := .Values.engine }}
{{- if or $e.enableLora $e.loraModules $e.allowRuntimeLoraUpdating }}
{{- fail "a drafter pool does not serve LoRA adapters: engine.enableLora (engine.loraModules, engine.allowRuntimeLoraUpdating) needs a drafter per engine group (drafterPool.replicas: 0)" }}
{{- end }}
{{- $a := $p.autoscaling }}
{{- $members := ternary (int $a.maxReplicas) (int $p.replicas) (not (not $a.enabled)) }}
{{- $groups := ternary (int .Values.autoscaling.maxGroups) (int .Values.engineGroups) (not (not .Values.autoscaling.enabled)) }}
{{- if lt (mul $members (int $p.poolGroups)) $groups }}
{{- fail (printf "drafterPool serves at most %d engine groups (%d members x drafterPool.poolGroups %d) but the release runs up to %d: a group without a member decodes target-only; raise drafterPool.%s or drafterPool.poolGroups" (mul $members (int $p.poolGroups)) $members (int $p.poolGroups) $groups (ternary "autoscaling.maxReplicas" "replicas" (not (not $a.enabled)))) }}
{{- end }}
{{- if $a.enabled }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "drafterPool.autoscaling.minReplicas (%d) is above drafterPool.autoscaling.maxReplicas (%d)" (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- end }}
{{- if not .Values.scheduler.metricsPort }}
{{- fail "drafterPool.autoscaling reads the schedulers' minedraft:drafter_pool_queue: scheduler.metricsPort must not be 0" }}
{{- end }}
{{- end }}
{{- $drain := int .Values.scheduler.drainTimeoutSeconds }}
{{- if lt (int $p.terminationGracePeriodSeconds) (add $drain 10 | int) }}
{{- fail (printf "drafterPool.terminationGracePeriodSeconds (%d) must be at least scheduler.drainTimeoutSeconds + 10 (%d): the pod would be killed while it drains" (int $p.terminationGracePeriodSeconds) (add $drain 10 | int)) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "minedraft.validateLora" -}}
{{- $e := .Values.engine }}
{{- $a := .Values.loraAdapters }}
{{- if and $e.allowRuntimeLoraUpdating (or (not $e.enableLora) (eq $a.volume.type "none")) }}
{{- fail "engine.allowRuntimeLoraUpdating needs engine.enableLora: true and an adapter volume (loraAdapters.volume.type existingClaim or emptyDir)" }}
{{- end }}
{{- if and $e.loraModules (not $e.enableLora) }}
{{- fail "engine.loraModules needs engine.enableLora: true" }}
{{- end }}
{{- if and $e.loraModules (eq $a.volume.type "none") }}
{{- fail "engine.loraModules name folders on the adapter volume: set loraAdapters.volume.type to existingClaim or emptyDir" }}
{{- end }}
{{- if and (eq $a.volume.type "existingClaim") (not $a.volume.existingClaim) }}
{{- fail "loraAdapters.volume.type=existingClaim needs loraAdapters.volume.existingClaim (the PersistentVolumeClaim's name)" }}
{{- end }}
{{- if eq $a.volume.type "emptyDir" }}
{{- range $e.loraModules }}
{{- if or (not $a.download.enabled) (not .repo) (and .draftPath (not .draftRepo)) }}
{{- fail (printf "loraAdapters.volume.type=emptyDir starts empty: enable loraAdapters.download and give adapter %q a repo (and a draftRepo with its draftPath), or use existingClaim" .name) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $a.download.enabled (eq $a.volume.type "none") }}
{{- fail "loraAdapters.download needs an adapter volume: set loraAdapters.volume.type to existingClaim or emptyDir" }}
{{- end }}
{{- end }}

{{/* The speculative config as the engine reads it: null keys dropped, models.draft resolved to a path. */}}
{{- define "minedraft.speculativeJson" -}}
{{- $spec := dict }}
{{- range $key, $value := .Values.speculativeConfig }}
{{- if not (kindIs "invalid" $value) }}
{{- if not (and (eq $key "model") (eq (toString $value) "")) }}
{{- $_ := set $spec $key $value }}
{{- end }}
{{- end }}
{{- end }}
{{- if .Values.models.draft }}
{{- $_ := set $spec "model" (printf "%s/%s" .Values.models.mountPath .Values.models.draft) }}
{{- end }}
{{- toJson $spec }}
{{- end }}

{{/*
The whole engine config (minedraft.config.EngineConfig) as the JSON every service of the group starts with
(MINEDRAFT_ENGINE_CONFIG). Field names are the engine's; values come from engine.*, verifier, models and
speculativeConfig. tests/test_chart.py checks that every EngineConfig field is set here.
*/}}
{{- define "minedraft.engineConfigJson" -}}
{{- $e := .Values.engine }}
{{- $config := dict "tensor_parallel_size" (int .Values.verifier.tensorParallelSize) "max_num_seqs" (int $e.maxNumSeqs) "dtype" $e.dtype "device" $e.device "seed" (int64 $e.seed) "batch_invariant" $e.batchInvariant "draft_support_size" (int $e.draftSupportSize) "gpu_memory_utilization" (float64 $e.gpuMemoryUtilization) "block_size" (int $e.blockSize) "max_num_batched_tokens" (int $e.maxNumBatchedTokens) "max_prediction_tokens" (int $e.maxPredictionTokens) "prediction_draft_tokens" (int $e.predictionDraftTokens) "enable_prefix_caching" $e.enablePrefixCaching "enforce_eager" $e.enforceEager "enable_lora" $e.enableLora "lora_modules" (include "minedraft.loraModules" . | fromJsonArray) "max_loras" (int $e.maxLoras) "max_cpu_loras" nil "max_lora_rank" (int $e.maxLoraRank) "allow_runtime_lora_updating" $e.allowRuntimeLoraUpdating "lora_root" nil "kv_cache_memory_bytes" nil "max_model_len" nil "model" nil "tokenizer" nil "speculative_config" nil }}
{{- if not (kindIs "invalid" $e.kvCacheMemoryBytes) }}
{{- $_ := set $config "kv_cache_memory_bytes" (int64 $e.kvCacheMemoryBytes) }}
{{- end }}
{{- if $e.allowRuntimeLoraUpdating }}
{{- $_ := set $config "lora_root" .Values.loraAdapters.mountPath }}
{{- end }}
{{- if not (kindIs "invalid" $e.maxCpuLoras) }}
{{- $_ := set $config "max_cpu_loras" (int $e.maxCpuLoras) }}
{{- end }}
{{- if not (kindIs "invalid" $e.maxModelLen) }}
{{- $_ := set $config "max_model_len" (int $e.maxModelLen) }}
{{- end }}
{{- with .Values.models.target }}
{{- $_ := set $config "model" (printf "%s/%s" $.Values.models.mountPath .) }}
{{- end }}
{{- with .Values.models.tokenizer }}
{{- $_ := set $config "tokenizer" (printf "%s/%s" $.Values.models.mountPath .) }}
{{- end }}
{{- if include "minedraft.speculative" . }}
{{- $_ := set $config "speculative_config" (include "minedraft.speculativeJson" . | fromJson) }}
{{- end }}
{{- toJson $config }}
{{- end }}

{{/* engine.loraModules as the engine reads them: paths under loraAdapters.mountPath (a JSON list). */}}
{{- define "minedraft.loraModules" -}}
{{- $root := .Values.loraAdapters.mountPath }}
{{- $modules := list }}
{{- range .Values.engine.loraModules }}
{{- $draft := ternary (printf "%s/%s" $root (.draftPath | default "")) nil (not (not .draftPath)) }}
{{- $modules = append $modules (dict "name" .name "path" (printf "%s/%s" $root .path) "draft_path" $draft) }}
{{- end }}
{{- toJson $modules }}
{{- end }}

{{/* The adapter volume (loraAdapters.volume), for the verifier and the drafter; empty when there is none. */}}
{{- define "minedraft.adapterVolume" -}}
{{- $v := .Values.loraAdapters.volume }}
{{- if eq $v.type "emptyDir" }}
- name: adapters
  emptyDir:
    sizeLimit: {{ $v.emptyDirSizeLimit }}
{{- else if eq $v.type "existingClaim" }}
- name: adapters
  persistentVolumeClaim:
    claimName: {{ $v.existingClaim }}
    readOnly: {{ not .Values.loraAdapters.download.enabled }}
{{- end }}
{{- end }}

{{- define "minedraft.adapterMount" -}}
{{- if ne .Values.loraAdapters.volume.type "none" }}
- name: adapters
  mountPath: {{ .Values.loraAdapters.mountPath }}
  readOnly: {{ not .Values.loraAdapters.download.enabled }}
{{- end }}
{{- end }}

{{/* Init containers fetching the adapters a worker loads: (dict "root" $ "image" .. "pullPolicy" .. "draft" bool):
     the target's (repo into path), or with draft the drafter's (draftRepo into draftPath). */}}
{{- define "minedraft.adapterDownloads" -}}
{{- $root := .root }}
{{- $a := $root.Values.loraAdapters }}
{{- if $a.download.enabled }}
{{- range $i, $m := $root.Values.engine.loraModules }}
{{- $repo := ternary $m.draftRepo $m.repo $.draft }}
{{- if $repo }}
{{- include "minedraft.downloadContainer" (dict "root" $root "name" (printf "download-%sadapter-%d" (ternary "draft-" "" $.draft) $i) "image" $.image "pullPolicy" $.pullPolicy "repo" $repo "dir" (ternary $m.draftPath $m.path $.draft) "patterns" "" "volume" "adapters" "mountPath" $a.mountPath "revision" $a.download.revision) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Checksum of everything that defines the engine group. All three pods carry it, so a change that restarts
one worker restarts the whole group: a new verifier cannot rejoin a running drafter's process group, and
the scheduler must rebuild its engine over the fresh workers.
*/}}
{{- define "minedraft.groupChecksum" -}}
{{- $group := dict "config" (include (print .Template.BasePath "/configmap.yaml") .) "image" .Values.image.worker "verifier" .Values.verifier "drafter" .Values.drafter "models" .Values.models "distributed" .Values.distributed "security" (list .Values.podSecurityContext .Values.securityContext) }}
{{- toJson $group | sha256sum }}
{{- end }}

{{/* Checksum of what a pool member runs: the engine config, the worker image, its own values (not its size, PDB or scaling) and the models.
     The pool is apart from the groups: a change of a group's workers alone does not restart it. */}}
{{- define "minedraft.poolChecksum" -}}
{{- $pool := dict "config" (include (print .Template.BasePath "/configmap.yaml") .) "image" .Values.image.worker "pool" (omit .Values.drafterPool "replicas" "autoscaling" "podDisruptionBudget") "models" .Values.models "security" (list .Values.podSecurityContext .Values.securityContext) }}
{{- toJson $pool | sha256sum }}
{{- end }}

{{- define "minedraft.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext }}
{{- end }}

{{- define "minedraft.containerSecurityContext" -}}
{{- toYaml .Values.securityContext }}
{{- end }}

{{/*
gRPC probes on one port: (dict "root" $ "port" 50061). startupProbe holds liveness and readiness back
until the model is loaded; that is how Kubernetes runs startupProbe, so liveness can never kill a loading
pod (the usual failure of LLM charts that put a short liveness delay on a model that loads for minutes).
*/}}
{{- define "minedraft.probes" -}}
{{- $p := .root.Values.probes -}}
{{- $check := include "minedraft.probeCheck" . -}}
startupProbe:
  {{- $check | nindent 2 }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds }}
readinessProbe:
  {{- $check | nindent 2 }}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
livenessProbe:
  {{- $check | nindent 2 }}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
{{- end }}

{{/* What a probe checks: grpc.health.v1 on .port, or with (dict ... "httpsHealth" true) the HTTP API's /health
     over TLS (Kubernetes' gRPC probes cannot speak TLS; /health answers 503 exactly while gRPC health
     reports NOT_SERVING). */}}
{{- define "minedraft.probeCheck" -}}
{{- if .httpsHealth -}}
httpGet:
  path: /health
  port: http
  scheme: HTTPS
{{- else -}}
grpc:
  port: {{ .port }}
  service: ""
{{- end }}
{{- end }}

{{/* Where a container finds the gateway's own API key (the one key the gateway sends to the schedulers,
     never a client's); "" when no API keys are configured or there is no gateway. */}}
{{- define "minedraft.gatewayKeyFile" -}}
{{- if and .Values.apiKeys.existingSecret .Values.gateway.enabled -}}
/etc/minedraft/gateway-key/key
{{- end }}
{{- end }}

{{/* The volume of that file: the apiKeys Secret, its gatewayKey entry only. */}}
{{- define "minedraft.gatewayKeyVolume" -}}
- name: gateway-key
  secret:
    secretName: {{ .Values.apiKeys.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.apiKeys.gatewayKey }}
        path: key
{{- end }}

{{- define "minedraft.gatewayKeyMount" -}}
- name: gateway-key
  mountPath: /etc/minedraft/gateway-key
  readOnly: true
{{- end }}

{{/* The Secret holding the scheduler's TLS certificate; "" = plaintext. */}}
{{- define "minedraft.tlsSecret" -}}
{{- if .Values.tls.existingSecret -}}
{{ .Values.tls.existingSecret }}
{{- else if .Values.tls.certManager.enabled -}}
{{ include "minedraft.fullname" . }}-scheduler-tls
{{- end }}
{{- end }}

{{/*
Container resources with the GPU count set from values: (dict "root" $ "resources" ... "gpuName" ... "gpus" N).
No GPU key at all with engine.device=cpu.
*/}}
{{- define "minedraft.resources" -}}
{{- $res := deepCopy (default dict .resources) }}
{{- if and (include "minedraft.gpu" .root) (gt (int .gpus) 0) }}
{{- $limits := deepCopy (default dict (get $res "limits")) }}
{{- $_ := set $limits .gpuName (int .gpus) }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Environment every service container gets on top of the ConfigMap. */}}
{{- define "minedraft.commonEnv" -}}
# The root filesystem is read-only: caches (torch, triton, Hugging Face) go to the /tmp emptyDir.
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
{{- end }}

{{/* The model volume, when one is configured: (dict "root" $ "readOnly" bool "own" bool).
     own = this pod gets its own emptyDir (the scheduler fetching only tokenizer files). */}}
{{- define "minedraft.modelVolume" -}}
{{- $v := .root.Values.models.volume }}
{{- if or .own (eq $v.type "emptyDir") }}
- name: models
  emptyDir:
    sizeLimit: {{ ternary "1Gi" $v.emptyDirSizeLimit .own }}
{{- else if ne $v.type "none" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ include "minedraft.claimName" .root }}
    readOnly: {{ .readOnly }}
{{- end }}
{{- end }}

{{/* Writable scratch space (the root filesystem is read-only) and, for workers, /dev/shm. */}}
{{- define "minedraft.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
{{- if and .shm (not .root.Values.distributed.hostIPC) }}
# Memory-backed /dev/shm: the runtime's 64 MiB default is too small for NCCL and the
# tensor-parallel ranks (the "Bus error" / NCCL "unhandled system error" of LLM pods).
# With hostIPC the pod uses the node's /dev/shm instead, so nothing is mounted over it.
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
{{- end }}
{{- end }}

{{- define "minedraft.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if and .shm (not .root.Values.distributed.hostIPC) }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- end }}

{{/*
One init container fetching a Hub repository: (dict "root" $ "name" .. "image" .. "repo" .. "dir" .. "patterns" ..);
optional "volume", "mountPath" and "revision" fetch into another volume than the models' (the adapters').
The token comes only from a secretKeyRef, never from values or the ConfigMap.
*/}}
{{- define "minedraft.downloadContainer" -}}
{{- $root := .root }}
{{- $mountPath := .mountPath | default $root.Values.models.mountPath }}
{{- $revision := ternary .revision $root.Values.models.download.revision (hasKey . "revision") }}
- name: {{ .name }}
  image: {{ .image }}
  imagePullPolicy: {{ .pullPolicy }}
  command:
    - python
    - -c
    - |
      import sys
      from huggingface_hub import snapshot_download
      repo, local_dir, revision, patterns = sys.argv[1:5]
      snapshot_download(repo_id=repo, local_dir=local_dir, revision=revision or None,
                        allow_patterns=patterns.split(",") if patterns else None)
      print(f"downloaded {repo} to {local_dir}", flush=True)
    - {{ .repo | quote }}
    - {{ printf "%s/%s" $mountPath .dir | quote }}
    - {{ $revision | quote }}
    - {{ .patterns | default "" | quote }}
  env:
    {{- include "minedraft.commonEnv" $root | nindent 4 }}
    - name: HF_HOME
      value: /tmp/huggingface
    {{- with $root.Values.hfToken.existingSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: {{ $root.Values.hfToken.key }}
    {{- end }}
  securityContext:
    {{- include "minedraft.containerSecurityContext" $root | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: {{ .volume | default "models" }}
      mountPath: {{ $mountPath }}
{{- end }}
