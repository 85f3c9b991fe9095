# syntax=docker/dockerfile:1
#
# admission-proxy: the runtime image.
#
#   docker build -t admission-proxy .
#   docker run --rm -p 8080:8080 -v "$PWD/my-config:/etc/admission-proxy:ro" admission-proxy
#   docker run --rm admission-proxy demo          # the built-in demo, inside the container
#
# Two stages: `build` installs the package and its runtime dependencies into a
# virtual environment; `runtime` copies only that environment onto a fresh slim
# Python. No compiler, build backend, dev tools, tests or pip end up in the
# final image's environment.
#
# The config is read from /etc/admission-proxy/config.yaml: mount a directory
# there (a Kubernetes ConfigMap, a compose bind mount). Mount the directory,
# not the file, so that edits reach the running proxy. Any key can be
# overridden with ADMISSION_<SECTION>__<KEY> (ADMISSION_SERVER__PORT=9000); the
# admin bearer token comes from ADMISSION_ADMIN_TOKEN; traces go where the
# standard OTEL_* variables say. See docs/DEPLOYMENT.md.

# Both stages must use the same image: the venv's interpreter is a symlink to it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/admission-proxy
ENV PATH=/opt/admission-proxy/bin:$PATH
WORKDIR /src
# Dependencies first, in their own layer, installed through a stub package:
# a change to the code does not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir proxy && touch proxy/__init__.py \
    && pip install . \
    && pip uninstall --yes admission-proxy \
    && rm -rf proxy build ./*.egg-info
COPY proxy ./proxy
# A regular (not editable) install, without the dev extra; then pip and
# setuptools leave the environment, since nothing installs at runtime.
RUN pip install --no-deps . \
    && pip uninstall --yes pip setuptools

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="admission-proxy" \
      org.opencontainers.image.description="Admission-control reverse proxy for GPU inference replicas" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric uid, so that Kubernetes' runAsNonRoot can verify it.
RUN groupadd --system --gid 10001 admission \
    && useradd --system --uid 10001 --gid admission --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin admission
COPY --from=build /opt/admission-proxy /opt/admission-proxy
# Defaults so that the image starts on its own; a mounted directory replaces them.
COPY config/example.yaml /etc/admission-proxy/config.yaml
COPY config/demo.yaml /etc/admission-proxy/demo.yaml
ENV PATH=/opt/admission-proxy/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
EXPOSE 8080
# SIGTERM starts the graceful drain (server.shutdown_grace_ms, 25 s by default):
# give the container at least that long to stop (docker stop -t 30,
# compose stop_grace_period, Kubernetes terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM
# Liveness only (/healthz: the process serves). Readiness (/readyz) belongs to
# the orchestrator's load balancing, not to the container's health.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('ADMISSION_SERVER__PORT', '8080') + '/healthz', timeout=2)"]
ENTRYPOINT ["admission-proxy"]
CMD ["serve", "--config", "/etc/admission-proxy/config.yaml"]
