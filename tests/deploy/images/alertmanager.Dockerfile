# A stand-in for prom/alertmanager, built from Debian's package because no image registry is
# reachable where tests/deploy/test_compose_up.py runs: the official image's shape (config
# in /etc/alertmanager, data in /alertmanager owned by nobody, runs as nobody, entry point
# the binary, the same default command), so compose.yaml runs it unchanged. Debian bookworm
# ships Alertmanager 0.25, compose.yaml pins 0.28.1 (tests/monitoring runs 0.25 on the same
# deploy/alertmanager.yml).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus-alertmanager >/dev/null \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /etc/alertmanager /alertmanager \
 && chown -R nobody:nogroup /etc/alertmanager /alertmanager
USER nobody
WORKDIR /alertmanager
EXPOSE 9093
VOLUME ["/alertmanager"]
ENTRYPOINT ["/usr/bin/prometheus-alertmanager"]
CMD ["--config.file=/etc/alertmanager/alertmanager.yml", "--storage.path=/alertmanager"]
