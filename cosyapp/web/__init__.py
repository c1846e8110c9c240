"""The HTTP edge: the FastAPI server, the API gate, the Gradio UI."""
