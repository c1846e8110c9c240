"""Turn user input into model input: text into sentences of token ids, prompt audio into a voice."""
