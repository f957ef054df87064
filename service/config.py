"""The service's configuration, one typed object per component, in one module: `ServiceConfig` (the Ray service:
engines, history store, failures), `GatewayConfig` (the HTTP gateway), and the parts they are made of. `das serve`
maps its flags onto these fields (service/cli.py); nothing here imports Ray, vLLM or the gateway."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from das.service.engine.factory import EngineSpec

TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces, added to a base URL


class HistoryPushConfig(BaseModel):
    """How engines push finished rollouts to a shard that is unavailable (restarting, dead)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    retry_s: float = Field(10.0, ge=0, description="seconds a push retries before keeping its records for the next "
                                                   "push (the group's stream ends only after its push)")
    backoff_s: float = Field(0.2, gt=0, description="first wait between retries, seconds; doubles each retry")
    max_backoff_s: float = Field(2.0, gt=0, description="longest wait between retries, seconds")
    max_pending_tokens: int = Field(8_000_000, ge=0, description="output tokens an engine keeps per node until a "
                                                                 "snapshot covers them (oldest given up first)")


class HistoryConfig(BaseModel):
    """Bounds and placement of the history store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shards: int = Field(2, ge=1, le=1024, description="HistoryStore actors; problems are spread by hash")
    window_versions: int = Field(2, ge=1, le=64, description="policy versions of rollouts kept per problem")
    max_records_per_problem: int = Field(64, ge=1, description="rollouts kept per problem (newest)")
    max_tokens: int = Field(50_000_000, ge=1, description="output tokens kept per shard (~4 bytes each)")
    snapshot_interval_s: float = Field(60.0, gt=0, description="seconds between snapshots of changed shards")
    max_restarts: int = Field(-1, ge=-1, description="Ray restarts of a dead shard actor (it restores its "
                                                     "snapshot); -1: no limit")
    push: HistoryPushConfig = HistoryPushConfig()


class FailureConfig(BaseModel):
    """How the service treats an engine actor that dies (its process, or the vLLM engine core inside it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_restarts: int = Field(5, ge=0, description="restarts an engine actor may have within the restart window; "
                              "the death after that fails the batches running on it, and it stays down")
    restart_window_s: float = Field(600.0, gt=0, description="seconds over which an engine's restarts count")
    recovery_timeout_s: float = Field(1800.0, gt=0, description="seconds a restarted engine may take to load the "
                                      "model and the served weights; longer fails it like an exhausted cap")
    max_group_deaths: int = Field(3, ge=1, description="engine deaths a group's unfinished samples may run "
                                      "through: at this many they end with finish_reason 'error' instead of running "
                                      "again, so a prompt that crashes the engine takes down this many engines, not "
                                      "every one in turn; a group's last try runs alone, so what only ran beside it "
                                      "is not given up with it")
    given_up_hold_s: float = Field(3600.0, ge=0, description="seconds a given-up group's prompt (with its sampling "
                                   "settings) is refused at admission, so a client retrying the error does not "
                                   "crash the engines again; 0: not refused")


class SessionConfig(BaseModel):
    """Bounds and placement thresholds of the sessions (GatewayConfig.sessions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    idle_expiry_s: float = Field(900.0, gt=0, description="seconds without a turn after which a session expires")
    max_open_sessions: int = Field(100_000, ge=1, description="open sessions at most; beyond, the least recently "
                                                              "active idle ones are evicted")
    max_context_tokens: int = Field(200_000_000, ge=1, description="summed context tokens (latest prompt + output) "
                                    "of the open sessions at most; beyond, the least recently active idle ones are "
                                    "evicted")
    overload_ratio: float = Field(2.0, ge=1.0, description="a session's engine is overloaded when its placed work "
                                  "exceeds this times the serving engines' mean plus overload_slack_tokens")
    overload_slack_tokens: float = Field(8192.0, ge=0, description="tokens of placed work an engine may hold above "
                                         "the ratio before it counts as overloaded (so idle clusters never move)")


class BatchJournalConfig(BaseModel):
    """Where the batch journal lives and how large it may grow."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state_dir: Path = Field(description="the service's state directory (das serve --state-dir)")
    max_bytes: int = Field(4 << 20, ge=4096, description="the file is compacted when an append takes it past "
                                                         "this; compaction keeps the newest batches in half of it")
    fsync: bool = Field(True, description="fsync every record before going on (off: tests only)")


class SessionJournalConfig(BaseModel):
    """Where the session journal lives, how large it may grow and how often it is written."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state_dir: Path = Field(description="the service's state directory (das serve --state-dir)")
    max_bytes: int = Field(16 << 20, ge=4096, description="the file is rewritten as the open sessions' records "
                                                          "when an append takes it past this")
    flush_s: float = Field(0.5, ge=0, description="seconds records wait on the event loop before the writer thread "
                                                  "appends them (one write and fsync for all)")
    fsync: bool = Field(True, description="fsync every write (off: tests only)")


class ServiceConfig(BaseModel):
    """Everything that shapes the service. `engine`: every engine's configuration (service/engine/factory.py
    `EngineSpec`): vLLM's (its `model` may be a known model name, prepared on each node) or, with `kind: stub`, the
    stub's (no model: tests and load tests)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineSpec
    address: str | None = Field(None, description="Ray cluster to join ('auto' or HOST:PORT); unset: an "
                                       "embedded single-node cluster")
    state_dir: Path | None = Field(None, description="history snapshots; None: history lives in memory only")
    history: HistoryConfig = HistoryConfig()
    stats_interval_s: float = Field(2.0, gt=0, description="seconds between engine and store figure refreshes")
    object_store_mib: int = Field(256, ge=64, description="object store of an embedded cluster, MiB")
    engines_per_node: int = Field(1, ge=1, description="engines on each node without a GPU, each in a NodeEngine "
                                  "actor of its own so that one dying leaves the others serving (a GPU node runs "
                                  "its GPUs / the engine's tensor_parallel_size, an actor each)")
    failure: FailureConfig = FailureConfig()
    adopt_nodes_interval_s: float = Field(10.0, gt=0, description="seconds between looks for Ray nodes that joined "
                                          "after the start (a replaced or added worker pod) and have no engine yet; "
                                          "each gets its engine actors")
    stream_items_per_s: float = Field(60.0, gt=0, description="Ray objects per second the coordinator aims to "
                                      "receive from all engine actors' streams together: each actor sends its engines' "
                                      "finished samples and progress together, an object every max(50 ms, actors / "
                                      "this) at most often, the interval capped at 5 s (the coordinator's CPU goes per "
                                      "object, ~1.2-4 ms each with the gateway's write on a busy 2-core host, so 60 a "
                                      "second take ~0.1-0.25 of a core: docs/design.md \"The coordinator at "
                                      "scale\")")
    target_engines: int | None = Field(None, ge=1, description="engines the service wants, on GPU nodes: asked of "
                                       "Ray as that many bundles of an engine's GPUs (tensor_parallel_size each; "
                                       "ray.autoscaler.sdk.request_resources), which an autoscaler (KubeRay's) adds "
                                       "worker nodes for while they do not fit; engines start on GPU nodes only, "
                                       "up to this many, so nodes beyond them stay idle and an autoscaler removes "
                                       "them. Unset: no demand, engines on every node (every GPU node where there "
                                       "are any)")


class GatewayConfig(BaseModel):
    """Everything that configures the gateway. `token` is a SecretStr so it never shows in a repr or log."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token: SecretStr | None = Field(None, description="bearer token every API call must carry; unset: no auth")
    weights_root: Path | None = Field(None, description="checkpoint paths of weight reloads must lie under it; "
                                       "unset: reloads by path refused")
    max_batch_samples: int = Field(65536, ge=1, description="samples (sum of n) one batch may ask for")
    max_batches_in_flight: int = Field(64, ge=1, description="batches queued or running at once")
    batch_stall_timeout_s: float = Field(600.0, gt=0, description="a running batch in which no sample made a "
                                         "token for this long is failed and its running samples aborted (a sample "
                                         "generating steadily for longer is no stall)")
    stalls_until_unlive: int = Field(2, ge=1, description="batches failed in a row by batch_stall_timeout_s, no "
                                     "sample finishing anywhere in between, after which /healthz answers 503: the "
                                     "engines make no progress and only a restart of the process can help")
    max_body_bytes: int = Field(64 << 20, ge=1, description="request bodies over this are refused (413) before "
                                                            "they are parsed; split larger history imports")
    header_timeout_s: float = Field(10.0, gt=0, le=3600, description="a request's line and headers must arrive "
                                    "within this many seconds of the connection opening (or of the first byte of "
                                    "its next request), else 408 and the connection is closed (slowloris); applied "
                                    "by the server (das serve: request_guard.server_config), not the ASGI app")
    body_timeout_s: float = Field(60.0, gt=0, le=3600, description="a request body must have fully arrived this "
                                  "many seconds after its headers, else 408 and the connection is closed; at least "
                                  "max_body_bytes over the slowest client link")
    max_history_records: int = Field(1_000_000, ge=1, description="records one history import may carry")
    weight_update_idle_s: float = Field(300.0, gt=0, description="an open weight push (vLLM's weight transfer, "
                                        "/start_weight_update) with no call for this long is given up on every "
                                        "engine and the batches it held run on (the trainer died between calls)")
    retained_batches: int = Field(256, ge=0, description="ended batches whose results are kept for replay")
    retained_bytes: int = Field(1 << 30, ge=0, description="results kept over all retained ended batches, in "
                                                           "bytes of msgpack (about 3 a token, 12 with logprobs)")
    served_model_name: str | None = Field(None, min_length=1, description="the model name of the OpenAI-compatible "
                                          "routes; None: the backend's served_model_name if it has one, else 'das'")
    tool_call_parser: str | None = Field(None, min_length=1, description="vLLM's --tool-call-parser: the "
                                         "ToolParserManager name (e.g. hermes, for Qwen2.5) the engines parse chat "
                                         "replies' tool calls with")
    enable_auto_tool_choice: bool = Field(False, description="vLLM's --enable-auto-tool-choice: chat requests with "
                                          "tools and tool_choice auto get the calls parsed out of their replies; "
                                          "without it they are refused (400), as vLLM refuses them")
    openai_coalesce_s: float = Field(0.02, ge=0, le=10, description="OpenAI-compatible requests for one problem "
                                     "with equal prompt and sampling arriving within this many seconds run as one "
                                     "group (their n summed); 0: every request its own group")
    batch_journal: BatchJournalConfig | None = Field(None, description="where accepted batches are journaled, so "
                                                     "a batch id an earlier run accepted is refused (409), not "
                                                     "run again; None (no --state-dir): in memory only")
    sessions: SessionConfig = Field(SessionConfig(), description="bounds and placement thresholds of agent "
                                    "sessions (groups with a session_id; service/cluster/sessions.py)")
    freeze_gc: bool = Field(False, description="at startup, move every object alive to the garbage collector's "
                                               "permanent generation (gc.freeze); process-wide, so for the "
                                               "process that serves (das serve, the load test), not a library "
                                               "user's process")
    otlp_traces_endpoint: str | None = Field(None, description="the OTLP/HTTP collector that gets a trace per "
                                             "batch (service/http/tracing.py): its base URL (/v1/traces is added) "
                                             "or the traces URL itself; unset: nothing traced, nothing exported")
    otlp_traces_sample_ratio: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False,
                                            description="the share of batches traced, by trace id, among those "
                                            "whose request carries no traceparent (a trainer's traceparent decides "
                                            "for its batch by its sampled flag); bounds the exporters' cost")

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _traces_url(cls, endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        return traces_url(endpoint)

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self) -> GatewayConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice requires tool_call_parser (vLLM: --enable-auto-tool-choice "
                             "requires --tool-call-parser)")
        return self


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: `endpoint` as given when it names a path, else with /v1/traces added (a
    collector's base URL, as OTEL_EXPORTER_OTLP_ENDPOINT takes it). ValueError, naming what is wrong, for anything but
    http(s)://host[:port][/path]: credentials in the URL are refused, since export errors are logged with it."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r}: not an http(s) URL with a host (e.g. "
                         f"http://127.0.0.1:4318)")
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise ValueError("--otlp-traces-endpoint: give http(s)://host[:port][/path] only, without credentials, "
                         "query or fragment (a collector's credentials go in $OTEL_EXPORTER_OTLP_TRACES_HEADERS)")
    try:
        port = parts.port
    except ValueError as exc:  # a port out of range, or not a number
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r}: {exc}") from None
    if port == 0:
        raise ValueError(f"--otlp-traces-endpoint {endpoint!r}: port 0")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + TRACES_PATH
