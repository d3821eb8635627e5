#!/usr/bin/env bash
# Makes sure a RabbitMQ broker answers on 127.0.0.1:5672 for the tests and
# make local (FIFOBOX_TRANSPORT=rabbitmq): installs Debian's rabbitmq-server
# if it is missing, starts it (rabbitmq-server -detached) if it is not
# running, and creates the vhosts fifobox uses, granting the guest user
# (loopback only) everything in them:
#   fifobox       make local (pkg/transport/amqp.DefaultURL)
#   fifobox-test  a stable vhost for ad-hoc test runs
# The Go tests create a vhost of their own per test (fifobox-test-<random>,
# pkg/transport/amqp/amqptest) through the management API below and delete
# it afterwards (rabbitmqctl where the API does not answer, and for the
# profile tests' policies), so this script must leave rabbitmqctl usable too
# (run as root, or via sudo).
# It also enables the management plugin (online, on 127.0.0.1:15672 only):
# the provisioner creates the functions' broker users through its HTTP API,
# as it does on Amazon MQ (port 443 there), and the user tests use it.
# It never restarts a running broker and never touches other vhosts.
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
ctl() { as_root rabbitmqctl -q "$@"; }
running() { ctl status >/dev/null 2>&1; }

if ! command -v rabbitmqctl >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmqctl ]; then
  echo "ensure-rabbitmq: RabbitMQ not installed; installing rabbitmq-server from Debian packages" >&2
  as_root apt-get update -qq
  # The package's post-install may try to start the service; without
  # systemd that can fail harmlessly, and we start it below.
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq rabbitmq-server >/dev/null || true
  command -v rabbitmqctl >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmqctl ] ||
    { echo "ensure-rabbitmq: installing rabbitmq-server failed" >&2; exit 1; }
fi
export PATH="$PATH:/usr/sbin"

if ! running; then
  echo "ensure-rabbitmq: starting RabbitMQ (rabbitmq-server -detached)" >&2
  # The management listener on loopback only (rabbitmq.conf cannot name
  # it before the plugin is enabled: an unknown key stops the boot).
  as_root env RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-rabbitmq_management tcp_config [{ip,"127.0.0.1"},{port,15672}]' \
    rabbitmq-server -detached
  for _ in $(seq 1 90); do running && break; sleep 1; done
fi
running || { echo "ensure-rabbitmq: RabbitMQ did not start (see /var/log/rabbitmq)" >&2; exit 1; }
# The node answers rabbitmqctl before its AMQP listener is up.
ctl await_startup >/dev/null 2>&1 || true
for _ in $(seq 1 30); do (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null && break; sleep 1; done
(exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null ||
  { echo "ensure-rabbitmq: nothing listens on 127.0.0.1:5672" >&2; exit 1; }

mgmt_up() { (exec 3<>/dev/tcp/127.0.0.1/15672) 2>/dev/null; }
if ! mgmt_up; then
  echo "ensure-rabbitmq: enabling the management plugin online (127.0.0.1:15672)" >&2
  # Set before the plugin starts, so it listens on loopback only; enabling
  # a plugin online does not restart the broker.
  ctl eval 'application:set_env(rabbitmq_management, tcp_config, [{ip, "127.0.0.1"}, {port, 15672}]).' >/dev/null
  as_root rabbitmq-plugins -q enable --online rabbitmq_management >/dev/null
  for _ in $(seq 1 30); do mgmt_up && break; sleep 1; done
  mgmt_up || { echo "ensure-rabbitmq: the management API does not answer on 127.0.0.1:15672" >&2; exit 1; }
fi

for vhost in fifobox fifobox-test; do
  if ! ctl list_vhosts name | grep -qx "$vhost"; then
    ctl add_vhost "$vhost" >/dev/null
  fi
  ctl set_permissions -p "$vhost" guest '.*' '.*' '.*' >/dev/null
done
echo "ensure-rabbitmq: RabbitMQ $(ctl eval 'rabbit_misc:version().' 2>/dev/null | tr -d '"') ready on 127.0.0.1:5672 (vhosts fifobox, fifobox-test; management API 127.0.0.1:15672)" >&2
