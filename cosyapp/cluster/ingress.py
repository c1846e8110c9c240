"""The ingress: what the page and the HTTP API call instead of a Pipeline when cosyapp serves from
several replicas (``--replicas N``), each a whole Pipeline in a Ray Serve deployment (``replica.py``).

The page and the API run once, in this process; only synthesis crosses to the replicas.

Placement: one Serve application per replica index (``cosyapp-replica-0``, ...), each a deployment
of one replica (``num_replicas=1``, ``ray_actor_options={"num_gpus": ...}``). Serve places each
on a GPU of any node, health-checks it and starts it again when it dies; this ingress picks the
replica of each new stream itself. Serve's own routing (power of two choices over a deployment's
replicas) sees only requests in flight, not the queued token2wav work that says how loaded a
replica really is, and its pluggable request router is still an alpha API; with a deployment per
index the choice is ours, in a few lines, and a stream's replica is known by name for its fault
message.

Routing: a new stream goes to the serving replica with the most headroom, the fewest streams plus
queued token2wav jobs, ties to the one chosen least recently. The streams are this ingress's count:
every stream passes through it, so the count is exact at once, where a report is up to
``REPORT_PERIOD_S`` old; the queued jobs are the replica's latest report. A stream's chunks all
come from its replica through one streaming call. Whole clips (``synthesize``) are streams too, so
a Gradio batch spreads over the replicas.

Admission: ``FairAdmission`` runs here, over every replica's slots (``max_streams`` each), so
fairness across clients holds for the whole cluster; a replica's own admission then never waits.

Faults: each replica reports every ``REPORT_PERIOD_S``; one that does not answer, or whose stream
fails because its actor died, is left out of routing until it reports again (Serve restarts it). Its
running streams end with a ``BusyError`` saying so; the others are not touched.
"""

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cosyapp.engine.admission import FairAdmission
from cosyapp.engine.metrics import WINDOWS, Metrics
from cosyapp.engine.pipeline import AudioChunk, ServingFront
from cosyapp.engine.request import SynthesisRequest
from cosyapp.errors import BusyError, UserError
from cosyapp.options import ServeOptions

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from cosyapp.settings import Settings

log = logging.getLogger(__name__)

REPORT_PERIOD_S = 0.5
# A replica silent this long is left out of routing. Serve holds a request to a dead replica until
# its successor is ready (model loaded, engines warm), so the shorter, the fewer requests wait there;
# a replica's loop answers a report in milliseconds.
REPORT_TIMEOUT_S = 2.0
REPORT_CALLS = 2  # requests a replica takes beyond its streams: the ingress's reports
BATCH_GAUGES = ("lm_batch_size", "lm_max_batch_size", "token2wav_batch_size", "token2wav_max_batch_size")


def app_name(index: int) -> str:
    return f"cosyapp-replica-{index}"


@dataclass
class Replica:
    """The ingress's view of one replica: its handle, latest report (None: not answering), the
    streams this ingress runs on it, and how often it was lost."""

    index: int
    handle: "DeploymentHandle"
    report: dict[str, Any] | None = None
    streams: int = 0
    faults: int = 0
    chosen: int = -1  # when it was last chosen (the ingress's count of choices)

    @property
    def up(self) -> bool:
        return self.report is not None

    def latest(self, part: str) -> dict[str, Any]:
        """``part`` of its latest report, {} while it does not answer (read once: the report is
        replaced on the event loop while the panel's thread and /metrics read it)."""
        report = self.report
        return report[part] if report else {}

    def load(self) -> int:
        """Streams running on it plus its queued token2wav jobs: lower is more headroom."""
        report = self.report
        return self.streams + (report["queued_jobs"] if report else 0)

    def lost(self, why: str) -> None:
        """Leave it out of routing until it reports again."""
        if self.report is not None:
            self.faults += 1
            log.warning("replica %d lost (%s); routing around it until it is back", self.index, why)
        self.report = None

    def describe(self) -> dict[str, Any]:
        """Its line in /health and the metrics: where it runs, whether it serves, its load."""
        report = self.report
        health = report["health"] if report else {}
        return {
            "replica": self.index,
            "status": "serving" if report else "down",
            "device": report["device"] if report else None,
            "node": report["node"] if report else None,
            "engine": report["engine"] if report else None,
            "lm": health.get("lm"),
            "lm_restarts": health.get("lm_restarts", 0),
            "active_streams": self.streams,
            "queued_jobs": report["queued_jobs"] if report else 0,
            "requests": report["metrics"]["requests"] if report else None,  # since it (re)started
            "faults": self.faults,
        }


class ClusterMetrics(Metrics):
    """The ingress's own request metrics (TTFA and audio as the page and the API see them), the
    replicas' decoded tokens summed, and each replica's line (``replicas``), labelled on /metrics."""

    def __init__(self, replicas: list[Replica]):
        super().__init__()
        self.replicas = replicas

    def reported(self, name: str) -> list[float]:
        """``name`` of every answering replica's metrics snapshot."""
        return [r.latest("metrics").get(name) or 0 for r in self.replicas if r.up]

    def snapshot(self) -> dict[str, Any]:
        out = super().snapshot()
        for window in WINDOWS:
            name = f"tokens_per_s_{int(window)}s"
            out[name] = sum(self.reported(name))
        out["replicas"] = [r.describe() for r in self.replicas]
        return out

    def prometheus(self) -> str:
        lines = [super().prometheus().rstrip("\n")]
        rows = [(r.describe(), r.latest("metrics")) for r in self.replicas]
        series = {
            "replica_up": lambda line, m: float(line["status"] == "serving"),
            "replica_active_streams": lambda line, m: line["active_streams"],
            "replica_queued_jobs": lambda line, m: line["queued_jobs"],
            "replica_faults_total": lambda line, m: line["faults"],
            "replica_audio_per_s_10s": lambda line, m: m.get("audio_per_s_10s") or 0,
            "replica_tokens_per_s_10s": lambda line, m: m.get("tokens_per_s_10s") or 0,
        }
        for name, read in series.items():
            kind = "counter" if name.endswith("_total") else "gauge"
            lines.append(f"# TYPE cosyapp_{name} {kind}")
            for line, metrics in rows:
                value = float(read(line, metrics))
                lines.append(f'cosyapp_{name}{{replica="{line["replica"]}"}} {value:.6g}')
        return "\n".join(lines) + "\n"


class ClusterPipeline(ServingFront):
    """The Pipeline's interface as the web layer uses it (stream, synthesize, health, metrics,
    admission), served by the replicas behind ``handles``. ``launch`` builds one."""

    def __init__(
        self, handles: list["DeploymentHandle"], options: ServeOptions, device: str, owns_ray: bool = False
    ):
        self.replicas = [Replica(i, handle) for i, handle in enumerate(handles)]
        for replica in self.replicas:  # what the page is built with: the sample rate
            replica.report = replica.handle.report.remote().result(timeout_s=30)
        self.sample_rate: int = self.replicas[0].report["sample_rate"]
        self.device = torch.device(device)
        self.max_chars = options.max_text_chars
        self.metrics = ClusterMetrics(self.replicas)
        self.admission = FairAdmission(
            options.max_streams * len(handles), options.max_waiting, on_reject=self.metrics.rejected
        )
        self.owns_ray = owns_ray
        self._choices = itertools.count()
        self._watching: list[asyncio.Task] = []
        self._started = False

        def largest(name: str) -> Callable[[], float]:
            return lambda: max(self.metrics.reported(name), default=0)

        self.metrics.gauges.update(
            queue_depth=lambda: self.admission.waiting,
            gpu_memory_gb=lambda: sum(self.metrics.reported("gpu_memory_gb")),
            **{name: largest(name) for name in BATCH_GAUGES},  # the busiest replica's
        )

    async def start(self, warm_up: bool = False) -> None:
        """Start watching the replicas' reports (idempotent). The replicas started their engines,
        with the warm-up on a GPU, before Serve counted them ready; ``warm_up`` changes nothing."""
        if not self._started:
            self._watching = [asyncio.create_task(self._watch(r)) for r in self.replicas]
            self._started = True

    async def shutdown(self) -> None:
        """Stop watching and remove the replicas' applications (their engines stop); idempotent."""
        if not self._started:
            return
        self._started = False
        for task in self._watching:
            task.cancel()
        await asyncio.gather(*self._watching, return_exceptions=True)
        await asyncio.to_thread(self._remove)

    def _remove(self) -> None:
        import ray
        from ray import serve

        if self.owns_ray:  # the local Ray instance this process started: Serve and all, replicas first
            serve.shutdown()
            ray.shutdown()
            return
        for replica in self.replicas:
            serve.delete(app_name(replica.index))

    async def _watch(self, replica: Replica) -> None:
        from ray.exceptions import RayError

        async def ask() -> dict[str, Any]:
            return await replica.handle.report.remote()

        while True:
            try:
                replica.report = await asyncio.wait_for(ask(), REPORT_TIMEOUT_S)
            except (TimeoutError, RayError) as e:
                replica.lost(type(e).__name__)
            await asyncio.sleep(REPORT_PERIOD_S)

    def health(self) -> dict[str, object]:
        """/health of the cluster: serving while any replica serves; each replica's line."""
        answering = [health for health in (r.latest("health") for r in self.replicas) if health]
        serving = [h for h in answering if h["lm"] == "serving"]
        faults = [h["last_fault"] for h in answering if h["last_fault"]]
        return {
            "ok": self._started,
            "lm": "serving" if serving else "restarting",
            "lm_restarts": sum(h["lm_restarts"] for h in answering),
            "last_fault": faults[0] if faults else None,
            "active_streams": self.admission.active,
            "waiting": self.admission.waiting,
            "clients": self.admission.clients(),
            "replicas": [r.describe() for r in self.replicas],
        }

    def _choose(self) -> Replica:
        serving = [r for r in self.replicas if r.up]
        if not serving:
            raise BusyError("no replica is serving right now (they are restarting); try again in a moment")
        replica = min(serving, key=lambda r: (r.load(), r.chosen))
        replica.chosen = next(self._choices)
        return replica

    async def stream(self, request: SynthesisRequest) -> AsyncIterator[AudioChunk]:
        """``Pipeline.stream`` on the replica with the most headroom, behind this ingress's fair
        admission. Raises the replica's ``UserError``s as they are, and ``BusyError`` when the
        replica dies during the stream."""
        from ray.exceptions import RayActorError

        request.validate(self.max_chars)
        async with self.admission.slot(request.client):
            replica = self._choose()
            record = self.metrics.begin(request.request_id, request.mode)
            status = "failed"
            replica.streams += 1
            chunks = replica.handle.options(stream=True).stream.remote(request)
            try:
                async for item in chunks:
                    if isinstance(item, UserError):
                        raise item
                    self.metrics.audio(record, len(item.samples) / item.sample_rate)
                    yield item
                status = "done"
            except RayActorError:
                replica.lost("its stream failed")
                raise BusyError(
                    f"replica {replica.index}, which was making this audio, stopped; try again: "
                    "the other replicas take new requests while it restarts"
                ) from None
            except (asyncio.CancelledError, GeneratorExit):
                status = "cancelled"
                chunks.cancel()
                raise
            finally:
                replica.streams -= 1
                self.metrics.end(record, status)


def launch(settings: "Settings", model_dir: Path) -> ClusterPipeline:
    """Deploy ``settings.replicas`` replicas of the model in ``model_dir`` with Ray Serve and wait
    until each serves. Joins the Ray cluster of RAY_ADDRESS, or one already initialised in this
    process, else starts a local one (then shut down with the replicas)."""
    import ray
    from ray import serve

    from cosyapp.cluster.replica import PipelineReplica

    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init()
    gpus = settings.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) and settings.device != "cpu" else 0.0
    device = "cuda" if gpus else "cpu"
    options = settings.serve_options()
    serve.start(proxy_location="Disabled")  # the page and the API are this process's own server
    targets = []
    for index in range(settings.replicas):
        deployment = serve.deployment(
            PipelineReplica,
            name=f"replica-{index}",
            num_replicas=1,
            ray_actor_options={"num_gpus": gpus, "num_cpus": 1},
            max_ongoing_requests=options.max_streams + options.max_waiting + REPORT_CALLS,
            health_check_period_s=2,
            logging_config={"enable_access_log": False},  # reports twice a second; requests: ours
        )
        app = deployment.bind(index, model_dir, options, device, warm_up=device == "cuda")
        targets.append(serve.RunTarget(app, name=app_name(index), route_prefix=None))
    log.info("starting %d replicas (%s GPUs each)", settings.replicas, gpus)
    handles = serve.run_many(targets)
    return ClusterPipeline(handles, options, device, owns_ray)
