# The worker daemon on a GPU host. Build and run (see docs/operating.md, "Deploying"):
#   docker build -t sqs-batch-worker .
#   docker run --gpus all -e WORKER_QUEUE_URL=... sqs-batch-worker
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
# checkov:skip=CKV_DOCKER_7: the tag is pinned, in CUDA_IMAGE's default; checkov does not resolve build arguments
FROM ${CUDA_IMAGE}

# The CUDA build of the same torch version the project pins, and the torchvision made
# for it: its nvJPEG binding decodes JPEGs on the GPU (--decode auto picks it).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# tini is PID 1: it forwards SIGTERM to the daemon and reaps what exits.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv tini \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv \
    && pip install torch==2.13.0 torchvision==0.28.0 --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY worker ./worker
COPY stages ./stages
RUN pip install .

RUN useradd --system --uid 10001 --create-home worker \
    && mkdir -p /var/log/worker \
    && chown worker /var/log/worker
USER 10001
ENV WORKER_LOG_DIR=/var/log/worker \
    WORKER_METRICS_PORT=8000
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "worker", "healthcheck"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "python", "-m", "worker", "run"]
