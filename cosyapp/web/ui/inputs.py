"""What Gradio does to a request's values before a handler sees them, made a matter of that request.

Gradio preprocesses each value of an event with its component: range checks, type coercion, and for
files the check that they were uploaded to this server (then a copy into its cache). For a batched
event it does so for every request of the batch, and one value it rejects fails them all. So:

- the form's components hand values on as sent (``hand_on``), and our rules answer a bad one with
  the message the HTTP API gives (``engine/request.py``, ``SpeechForm.check``);
- what Gradio still rejects (a file that was not uploaded here, something else where a file belongs)
  fails only its own request (``isolate_requests``): a batched request gets a ``Refused`` row, a
  request alone a gr.Error, both with a readable message instead of a bare "Error";
- a request with too few or too many values is refused when it joins the queue: Gradio lines a
  batch up value by value and would cut every request to the shortest;
- a file named by URL is refused before Gradio would download it: the page uploads its recordings,
  and the server fetches nothing a client names.
"""

import logging
import math
from typing import Any, TypeVar

import gradio as gr
from gradio.data_classes import FileData
from gradio.exceptions import InvalidPathError
from gradio_client.utils import is_file_obj_with_meta, is_http_url_like, traverse

from cosyapp.engine.request import is_number, shown
from cosyapp.errors import UserError, VoiceError
from cosyapp.web.ui.form import Refused

log = logging.getLogger(__name__)

Component = TypeVar("Component", bound=gr.components.Component)


def hand_on(component: Component) -> Component:
    """``component`` handing its value to the handler as the client sent it, only rounding a finite
    number to the component's precision as Gradio does (a seed of 2.4 is 2). No range checks and no
    coercion: the handler's rules check the value. The page's control keeps its range for people.

    (An instance override: a Component subclass would make Gradio write a .pyi stub beside this
    module.)"""
    precision = getattr(component, "precision", None)

    def preprocess(payload: Any) -> Any:
        if is_number(payload) and math.isfinite(payload):
            return gr.Number.round_to_precision(payload, precision)
        return payload

    component.preprocess = preprocess
    return component


def isolate_requests(demo: gr.Blocks) -> None:
    """Make a value that Gradio's preprocessing rejects fail its own request only; call it after
    ``demo.queue()``, whose queue it wraps.

    Gradio preprocesses a batch one request at a time (``Blocks.preprocess_data``) but lets the
    first failure end the batch; this wraps that step of ``demo`` so a failed request becomes a
    ``Refused`` row for the batched handler, and a request of an unbatched event a gr.Error with
    ``refusal``'s message. (Instance overrides, as ``hand_on``: Gradio 6 has no per-request hook
    for batched events; its ``validator=`` fails every call of a batched event.)"""
    preprocess = demo.preprocess_data

    async def each_request(block_fn, inputs: list, state, explicit_call: bool = False) -> list:
        try:
            refuse_urls(inputs)
            return await preprocess(block_fn, inputs, state, explicit_call)
        except Exception as err:
            error = err if isinstance(err, UserError) else refusal(err, block_fn, inputs)
            if not block_fn.batch:
                raise gr.Error(error.message, print_exception=False) from err
            return [Refused(error)] * len(block_fn.inputs)

    queue = demo._queue
    push = queue.push

    async def push_whole(body, request, username):
        # Answered with HTTP 400 and the message; gradio_client always sends every value.
        fn = demo.fns.get(body.fn_index) if body.fn_index is not None else None
        if fn is not None and fn.batch and len(body.data) != len(fn.inputs):
            return False, f"This endpoint takes {len(fn.inputs)} values, got {len(body.data)}.", "error"
        return await push(body, request, username)

    demo.preprocess_data = each_request
    queue.push = push_whole


def refuse_urls(inputs: list) -> None:
    """Raise ``VoiceError`` when a value names a file by URL, which Gradio would download."""
    paths: list[str] = []
    traverse(inputs, lambda file: paths.append(file["path"]) or file, is_file_obj_with_meta)
    if any(is_http_url_like(path) for path in paths):
        raise VoiceError(
            "Upload the recording instead of naming it by URL: the server fetches no files "
            "(gradio_client: handle_file(a local path))."
        )


def refusal(err: Exception, block_fn: Any, inputs: list) -> UserError:
    """The user error for ``err``, raised by Gradio preprocessing the values ``inputs`` of an event
    of ``block_fn``: a file not uploaded here, something else where a file belongs, or a component's
    own check. Anything else is unexpected: logged with its traceback, answered in general terms."""
    if isinstance(err, InvalidPathError):
        return VoiceError(
            "Only files uploaded to this server can be used: upload the recording first "
            f"(gradio_client: handle_file(path)). {err}"
        )
    names = block_fn.input_parameter_names or [None] * len(block_fn.inputs)
    for name, block, value in zip(names, block_fn.inputs, inputs, strict=False):
        if takes_file(block) and value is not None and not is_file_obj_with_meta(value):
            return VoiceError(
                f"The {name or 'recording'} must be an uploaded file (gradio_client: handle_file(path)) "
                f"or null, got {shown(value)}."
            )
    if isinstance(err, gr.Error):
        return UserError(str(err.message))
    log.error("Gradio could not preprocess a request", exc_info=err)
    return UserError("The request's values do not fit this endpoint's parameters; its API page lists them.")


def takes_file(block: Any) -> bool:
    model = getattr(block, "data_model", None)
    return isinstance(model, type) and issubclass(model, FileData)
