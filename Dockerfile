# stepbudget daemon image: the package installed from its wheel on a slim Python base, run as a
# non-root user. The Helm chart runs it with a read-only root filesystem (only /tmp is writable)
# and `serve --config /etc/stepbudget/config.yaml`.
#
# The base: any Debian-like image with python3 (3.11 or later) and its venv module. make release-check
# builds on a Debian bookworm base made here by mmdebstrap (scripts/build-image.sh), with
# --build-arg PYTHON_IMAGE=localhost/stepbudget-base:bookworm. The package goes into a venv because a
# distribution's python3 refuses pip installs outside one (PEP 668); on the slim image it costs nothing.
ARG PYTHON_IMAGE=python:3.11-slim

# Build stage: only the wheel leaves it (no sources, tests or build tools in the final image).
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY exporter ./exporter
RUN python3 -m venv /build && /build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/stepbudget/bin:$PATH
# The same uid/gid as the chart's runAsUser/runAsGroup.
RUN groupadd --system --gid 65532 stepbudget \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin stepbudget
COPY --from=wheel /wheels /wheels
RUN python3 -m venv /opt/stepbudget && /opt/stepbudget/bin/pip install /wheels/*.whl && rm -rf /wheels
USER 65532:65532
EXPOSE 9421
ENTRYPOINT ["stepbudget"]
CMD ["serve", "--config", "/etc/stepbudget/config.yaml"]
