# Tandem in one container: `tandem serve` on a CUDA-capable PyTorch image.
#
#   docker build -t tandem .
#   docker run --gpus all -p 8000:8000 -v tandem-models:/models tandem
#   docker run --gpus all -p 8000:8000 -v tandem-models:/models tandem \
#       tandem serve --host 0.0.0.0 --model /models/my-model --api-key sk-local
#
# The model cache (and the C++ CPU expert pool's build cache) live under TANDEM_HOME=/models,
# a volume. Both are filled at build time, so a fresh named volume starts with them; a bind
# mount over /models hides them and they are fetched / rebuilt once on first use (g++ stays in
# the image for that). Checked by tests/test_dockerfile.py; it cannot be built on the CI hosts.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    TANDEM_HOME=/models

# Compiler for the C++ CPU expert pool (ext/cpu, built with pybind11 against this Python's
# headers, which the base image's Python ships).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make \
    && rm -rf /var/lib/apt/lists/* \
    && python -c "import os, sysconfig; h = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); assert os.path.exists(h), h"

WORKDIR /opt/tandem
COPY pyproject.toml setup.py __init__.py README.md ./
COPY tools/install.sh tools/torch_choice.py tools/
COPY ext ext
COPY models models
COPY runtime runtime
COPY app app

# install.sh keeps the base image's CUDA torch; CuPy for the GPU attention kernels.
RUN python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    && bash tools/install.sh \
    && python -m pip install cupy-cuda12x \
    && tandem --help > /dev/null

# Warm build of the C++ CPU expert pool into $TANDEM_HOME/cpu_ext.
RUN python -c "from tandem.ext.cpu import CpuExpertPool; CpuExpertPool(num_threads=1).close()"

# Fetch the default model into $TANDEM_HOME (--build-arg PREFETCH_MODEL=0 to fetch at run time).
ARG PREFETCH_MODEL=1
RUN if [ "$PREFETCH_MODEL" = "1" ]; then \
        python -c "from tandem.models.hub import resolve_model; print(resolve_model(None))"; \
    fi

VOLUME /models
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"
CMD ["tandem", "serve", "--host", "0.0.0.0"]
