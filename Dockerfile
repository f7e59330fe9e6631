# vllm-cache-exporter: the sidecar image (also runs `simulate` and `drive` for the compose demo).
#
# Two stages: the first builds a virtualenv with pip, the second copies only that venv onto a
# fresh slim base, so no pip cache, wheel build directory or build tool reaches the image.
# Every runtime dependency ships manylinux wheels, so no compiler is needed in either stage.
#
# The base is a build argument: by default the pinned python image, or any Debian-like image
# whose python3 (3.10 or newer) has the venv module, e.g. Debian bookworm with Debian's
# python3 and python3-venv:
#   docker build --build-arg BASE_IMAGE=my-registry/debian-python3:bookworm .
# Both stages use the same base, so the venv's python links resolve in the final image.
# tests/deploy/test_dockerfile.py checks this file statically; tests/deploy/test_compose_up.py
# builds it on a Debian base and runs compose.yaml with it.
ARG BASE_IMAGE=python:3.11.14-slim-bookworm

FROM ${BASE_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
# python3, not python: Debian's own python3 has no `python` command (the venv has one).
RUN python3 -m venv /opt/venv
WORKDIR /src
# Only what the package build reads (pyproject's readme is README.md); .dockerignore keeps
# everything else out of the build context.
COPY pyproject.toml README.md ./
COPY exporter ./exporter
# The re2 extra: the operator's caller and model patterns matched in linear time.
RUN /opt/venv/bin/pip install --no-cache-dir '.[re2]'

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="vllm-cache-exporter" \
      org.opencontainers.image.description="Prometheus sidecar for vLLM: per-caller prefix-cache hit ratio, warm/cold TTFT, preemptions, KV occupancy in tokens." \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 exporter \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin exporter
COPY --from=build /opt/venv /opt/venv
# The listen address is set through the environment, not a CMD flag, so the HEALTHCHECK
# below reads the same port the server binds; override both with this one variable.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VLLM_CACHE_EXPORTER_WEB_LISTEN_ADDRESS=0.0.0.0:10123
USER 10001:10001
EXPOSE 10123
# No curl in a slim image: the interpreter that is already there does the probe.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('VLLM_CACHE_EXPORTER_WEB_LISTEN_ADDRESS', '0.0.0.0:10123').rpartition(':')[2]; urllib.request.urlopen('http://127.0.0.1:' + port + '/-/healthy', timeout=4)"]
ENTRYPOINT ["vllm-cache-exporter"]
CMD ["run"]
