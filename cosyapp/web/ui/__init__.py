"""The Gradio web UI: layout, events, live panel. No model logic and no torch here."""

from cosyapp.web.ui.layout import build_demo, launch_options, mount_options

__all__ = ["build_demo", "launch_options", "mount_options"]
