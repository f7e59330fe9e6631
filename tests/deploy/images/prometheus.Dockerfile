# A stand-in for prom/prometheus, built from Debian's package because no image registry is
# reachable where tests/deploy/test_compose_up.py runs: the official image's shape (binaries
# in /bin, config in /etc/prometheus, data in /prometheus owned by nobody, runs as nobody,
# entry point the binary, the same default command), so compose.yaml runs it unchanged.
# Debian bookworm ships Prometheus 2.42, compose.yaml pins 3.5: the rules and config use
# nothing 2.42 lacks (tests/monitoring runs the same binary on the same files).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus \
 && chown -R nobody:nogroup /etc/prometheus /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
VOLUME ["/prometheus"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
