"""cosyapp entry point: flags and environment -> Settings -> Service -> web app (UI + HTTP API) served.

Hosts that say where to listen through the environment are honoured: GRADIO_SERVER_NAME /
GRADIO_SERVER_PORT (Gradio's own variables), PORT, and SPACE_ID (on a Hugging Face Space the app must
listen on every interface). They only change the defaults; COSYAPP_HOST / COSYAPP_PORT and the flags win.

On a GPU the stream limit and vLLM's share are sized to the card's memory unless given
(cosyapp/deploy/sizing.py). A ZeroGPU Space gets an explanation and exit status 1; a Space without a
GPU serves the demo model.
"""

import logging
import os
import signal
import sys
from dataclasses import replace

from cosyapp.deploy.space import CPU_SPACE_REASON, ZERO_GPU_MESSAGE, on_space, on_zero_gpu
from cosyapp.settings import CARD_SIZED, Settings, parse_settings

log = logging.getLogger("cosyapp")


def apply_host_conventions(environ: dict[str, str]) -> None:
    """Turn the hosting platform's variables into COSYAPP_HOST / COSYAPP_PORT defaults in ``environ``."""
    host = environ.get("GRADIO_SERVER_NAME") or ("0.0.0.0" if environ.get("SPACE_ID") else None)
    port = environ.get("GRADIO_SERVER_PORT") or environ.get("PORT")
    if host:
        environ.setdefault("COSYAPP_HOST", host)
    if port:
        environ.setdefault("COSYAPP_PORT", port)


def security_warnings(settings: Settings) -> list[str]:
    """What ``settings`` leave open that an operator should know about, one sentence each."""
    warnings = []
    if settings.share:
        warning = (
            "--share: publishing a public link; ANYONE with the link can use this app and its GPU, "
            "and the voices shared in it"
        )
        if settings.auth is None:
            warning += ". There is NO LOGIN: add --auth USER:PASSWORD (or COSYAPP_AUTH) to require one"
        warnings.append(warning)
    if settings.auth is not None and settings.api_key is None:
        warnings.append(
            "--auth protects the web UI only: /v1/audio/speech is open to anyone who can reach this "
            "server; set --api-key (or COSYAPP_API_KEY) to close it"
        )
    return warnings


def fit_to_host(settings: Settings) -> tuple[Settings, str | None]:
    """``settings`` with the options left unset sized to the GPU (logged), and the demo reason of a
    Space without a GPU (None elsewhere). On a GPU, vLLM's plugin is made visible first when cosyapp
    runs from an uninstalled source tree (a Space). Raises CardTooSmall."""
    from cosyapp.deploy.plugin import provide_vllm_plugin
    from cosyapp.deploy.sizing import read_card, size_for_card

    card = read_card(settings.device)
    if card is None:
        return settings, CPU_SPACE_REASON if on_space(os.environ) and not settings.demo else None
    if provide_vllm_plugin(settings.cache_dir / "vllm-plugin"):
        log.info("cosyapp is not installed: vLLM finds its plugin in %s", settings.cache_dir / "vllm-plugin")
    given = {name: None if name in settings.card_sized else getattr(settings, name) for name in CARD_SIZED}
    sizing = size_for_card(
        *card, flow_cache_gb=settings.flow_cache_gb, flow_cache_inputs=settings.flow_cache_inputs, **given
    )
    log.info("%s", sizing.describe())
    sized = {name: getattr(sizing, name) for name in CARD_SIZED}
    return replace(settings, **sized, card=sizing), None


def main(argv: list[str] | None = None) -> int:
    apply_host_conventions(os.environ)
    settings = parse_settings(argv)  # before any heavy import, so --help and flag errors are instant
    if on_zero_gpu(os.environ):
        print(ZERO_GPU_MESSAGE, file=sys.stderr)
        return 1
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # read when gradio is imported
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from cosyapp.deploy.sizing import CardTooSmall
    from cosyapp.service import build_service
    from cosyapp.web.server import build_app, launch_shared

    try:
        settings, demo_reason = fit_to_host(settings)
    except CardTooSmall as e:
        log.error("%s", e)
        return 1
    service = build_service(settings, demo_reason)
    if service.demo_reason:
        log.warning("DEMO MODE (%s): a tiny random-weight model, it speaks noise", service.demo_reason)
    log.info("model %s; serving on http://%s:%d", service.model_dir, settings.host, settings.port)
    for warning in security_warnings(settings):
        log.warning("%s", warning)
    if settings.share:
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as gracefully as on Ctrl+C
        launch_shared(service, settings.host, settings.port)
        return 0
    import uvicorn

    # On SIGTERM uvicorn stops accepting, lets running requests finish for up to the timeout, cancels
    # the rest, stops the engines, then raises the signal again: with this handler it returns, exit 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: log.info("stopped by SIGTERM"))
    uvicorn.run(
        build_app(service),
        host=settings.host,
        port=settings.port,
        log_config=None,
        timeout_graceful_shutdown=settings.shutdown_timeout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
