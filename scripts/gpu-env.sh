# Sourced by the GPU scripts: vLLM from the carry build's parts (unpacked once into /tmp/site), the
# wheels in .gpu-wheels/ installed beside it, and the entry point through which vLLM's engine process
# finds cosyapp's model. Leaves PYTHONPATH and PATH set for python -m cosyapp... and scripts/*.py.
[ -d /tmp/site/vllm ] || { mkdir -p /tmp/site && cat /tmp/parts/part_* | xz -d | tar -x -C /tmp/site; }
if [ -d .gpu-wheels ] && [ ! -f /tmp/site/.wheels-done ]; then
    python -m pip install -q --no-deps --upgrade --target /tmp/site .gpu-wheels/*.whl && touch /tmp/site/.wheels-done
fi
# vLLM finds out-of-tree models through an installed distribution's entry point.
mkdir -p /tmp/site/cosyapp_plugin-0.dist-info
printf 'Metadata-Version: 2.1\nName: cosyapp-plugin\nVersion: 0\n' > /tmp/site/cosyapp_plugin-0.dist-info/METADATA
printf '[vllm.general_plugins]\ncosyapp = cosyapp.engine.lm.vllm_model:register\n' \
    > /tmp/site/cosyapp_plugin-0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_CONFIGURE_LOGGING=0 PATH=/tmp/site/bin:$PATH
