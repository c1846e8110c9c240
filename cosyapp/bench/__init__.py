"""``python -m cosyapp.bench``: latency and throughput of cosyapp against concurrency, beside baselines.

load.py       the reproducible load: model folder, prompt voice, texts, decoding lengths
drivers.py    how a request is sent: in-process Pipeline, OpenAI-style HTTP, gradio_client
serving.py    the benchmark's own server (the app of cosyapp.web.server on a free loopback port)
stats.py      per-request results, latency/throughput/underrun summaries, engine statistics
levels.py     one setting: N concurrent requests through a driver, measured
baselines.py  the alternatives on the same model and load, and cosyapp's ratios to them
report.py     hardware, versions, table rows and the PNG figures
reference.py  the plain PyTorch reference path, baseline (a)
run.py        the whole run; __main__.py: the command line
"""
