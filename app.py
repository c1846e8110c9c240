"""cosyapp entry point: flags and environment -> Settings -> Service -> web app (UI + HTTP API) served.

Hosts that say where to listen through the environment are honoured: GRADIO_SERVER_NAME /
GRADIO_SERVER_PORT (Gradio's own variables), PORT, and SPACE_ID (on a Hugging Face Space the app must
listen on every interface). They only change the defaults; COSYAPP_HOST / COSYAPP_PORT and the flags win.
"""

import logging
import os
import signal
import sys

from cosyapp.settings import Settings, parse_settings

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


def main(argv: list[str] | None = None) -> int:
    apply_host_conventions(os.environ)
    settings = parse_settings(argv)  # before any heavy import, so --help and flag errors are instant
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # read when gradio is imported
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from cosyapp.service import build_service
    from cosyapp.web.server import build_app, launch_shared

    service = build_service(settings)
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
