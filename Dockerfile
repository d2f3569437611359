# stepbudget daemon image: the package installed from its wheel on a slim Python base, run as a
# non-root user. The Helm chart runs it with a read-only root filesystem (only /tmp is writable)
# and `serve --config /etc/stepbudget/config.yaml`.

# Build stage: only the wheel leaves it (no sources, tests or build tools in the final image).
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY exporter ./exporter
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The same uid/gid as the chart's runAsUser/runAsGroup.
RUN groupadd --system --gid 65532 stepbudget \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin stepbudget
COPY --from=wheel /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels
USER 65532:65532
EXPOSE 9421
ENTRYPOINT ["stepbudget"]
CMD ["serve", "--config", "/etc/stepbudget/config.yaml"]
