"""cosyapp: serve CosyVoice 2 text-to-speech to many browser sessions from one shared pipeline."""

__version__ = "0.1.0"
