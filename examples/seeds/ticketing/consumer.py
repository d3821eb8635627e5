"""Ticketing inventory consumer, written from PRD-005 (seeds/003) alone.

internal/seeds runs it unchanged against fifobox. What it follows:

- TR-3/TR-4/TR-5: declares the exchange ticketing.events (topic, durable),
  the queue inventory.events (durable, x-dead-letter-exchange ticketing.dlx,
  x-dead-letter-routing-key inventory.events.dlq) bound to hold.* and
  order.confirmed, the DLX ticketing.dlx (direct) and inventory.events.dlq.
- TR-9: pika, prefetch 10, manual acknowledgement, graceful shutdown.
- TR-1: handler (deserialize, validate, route) / service (business logic,
  idempotency) / store (persistence, consumed_events), the business write
  and the dedup insert in one transaction (FR-6).
- FR-5, NFR-6: the event schema is validated strictly; a malformed event
  goes to the DLQ at once (TR-10: "Validation | DLQ immediately").
- FR-7, FR-8, TR-10: a transient failure is retried with exponential
  backoff; after 3 retries the message is nacked without requeue, which
  routes it to the DLQ. The message's x-retry-count header (0 when
  published) counts the retries: a requeued message keeps its headers, so a
  retry is a copy republished to this queue with x-retry-count + 1, and the
  original is acknowledged.

Usage: DATABASE_URL=... RABBITMQ_URL=... python3 consumer.py
Prints "ready" once consuming. Test hook (not in the PRD): a payload with
"fail_deliveries": k fails its first k deliveries with a transient error.
"""

import json
import os
import signal
import sys
import time
import uuid
from datetime import datetime

import pika
import psycopg

QUEUE = "inventory.events"
MAX_RETRIES = 3
BACKOFF_BASE_S = 0.2


class ValidationError(Exception):
    """A malformed event: retrying cannot help."""


class TransientError(Exception):
    """A failure a retry may not meet (a dependency timing out)."""


# ----------------------------------------------------------------- store
class Store:
    def __init__(self, dsn):
        self.conn = psycopg.connect(dsn)

    def apply(self, event, delivery):
        """Records the event as consumed and applies it, in one transaction.
        Returns False when consumed_events already holds it."""
        with self.conn.transaction():
            cur = self.conn.execute(
                "INSERT INTO consumed_events (event_id, event_type, consumed_at) VALUES (%s, %s, now()) "
                "ON CONFLICT (event_id) DO NOTHING",
                (event["event_id"], event["event_type"]),
            )
            if cur.rowcount == 0:
                return False
            self.conn.execute(
                "INSERT INTO inventory_applied (event_id, event_type, aggregate_id, n, idempotency_key, retry_count, "
                "message_id, timestamp_s, content_type, delivery_mode) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (event["event_id"], event["event_type"], event["aggregate_id"], event["payload"].get("n"),
                 event.get("idempotency_key"), delivery["retry_count"], delivery["message_id"], delivery["timestamp"],
                 delivery["content_type"], delivery["delivery_mode"]),
            )
            return True


# --------------------------------------------------------------- service
class InventoryService:
    def __init__(self, store):
        self.store = store

    def handle(self, event, delivery):
        failing = event["payload"].get("fail_deliveries", 0)
        if delivery["retry_count"] < failing:
            raise TransientError("inventory dependency timed out")
        if not self.store.apply(event, delivery):
            print("duplicate event %s acknowledged without processing" % event["event_id"], file=sys.stderr)


# --------------------------------------------------------------- handler
REQUIRED = {"event_id": str, "event_type": str, "occurred_at": str, "aggregate_id": str, "payload": dict}


def validate(body):
    try:
        event = json.loads(body)
    except ValueError as e:
        raise ValidationError("not JSON: %s" % e)
    if not isinstance(event, dict):
        raise ValidationError("not an object")
    for field, typ in REQUIRED.items():
        if not isinstance(event.get(field), typ):
            raise ValidationError("%s: missing or not a %s" % (field, typ.__name__))
    for field in ("event_id", "aggregate_id"):
        uuid.UUID(event[field])
    if "idempotency_key" in event:
        uuid.UUID(event["idempotency_key"])
    datetime.fromisoformat(event["occurred_at"].replace("Z", "+00:00"))
    if event["payload"].get("invalid"):
        raise ValidationError("payload: rejected by the schema")
    return event


class Handler:
    def __init__(self, channel, service):
        self.channel = channel
        self.service = service

    def on_message(self, ch, method, props, body):
        headers = props.headers or {}
        delivery = {
            "retry_count": int(headers.get("x-retry-count", 0)),
            "message_id": props.message_id,
            "timestamp": props.timestamp,
            "content_type": props.content_type,
            "delivery_mode": props.delivery_mode,
        }
        try:
            event = validate(body)
        except (ValidationError, ValueError) as e:
            print("invalid event, to the DLQ: %s" % e, file=sys.stderr)
            ch.basic_nack(method.delivery_tag, requeue=False)
            return
        try:
            self.service.handle(event, delivery)
        except TransientError as e:
            n = delivery["retry_count"]
            if n >= MAX_RETRIES:
                print("event %s failed after %d retries, to the DLQ: %s" % (event["event_id"], n, e), file=sys.stderr)
                ch.basic_nack(method.delivery_tag, requeue=False)
                return
            time.sleep(BACKOFF_BASE_S * 2 ** n)
            retry_headers = dict(headers)
            retry_headers["x-retry-count"] = n + 1
            ch.basic_publish(
                exchange="",
                routing_key=QUEUE,
                body=body,
                properties=pika.BasicProperties(
                    content_type=props.content_type, delivery_mode=2, message_id=props.message_id,
                    timestamp=props.timestamp, type=props.type, headers=retry_headers),
            )
            ch.basic_ack(method.delivery_tag)
            return
        ch.basic_ack(method.delivery_tag)


def main():
    store = Store(os.environ["DATABASE_URL"])
    params = pika.URLParameters(os.environ["RABBITMQ_URL"])
    connection = pika.BlockingConnection(params)
    channel = connection.channel()
    # TR-3
    channel.exchange_declare("ticketing.events", exchange_type="topic", durable=True, auto_delete=False)
    # TR-5
    channel.exchange_declare("ticketing.dlx", exchange_type="direct", durable=True)
    channel.queue_declare("inventory.events.dlq", durable=True)
    channel.queue_bind("inventory.events.dlq", "ticketing.dlx", routing_key="inventory.events.dlq")
    # TR-4
    channel.queue_declare(QUEUE, durable=True, arguments={
        "x-dead-letter-exchange": "ticketing.dlx",
        "x-dead-letter-routing-key": "inventory.events.dlq",
    })
    for key in ("hold.*", "order.confirmed"):
        channel.queue_bind(QUEUE, "ticketing.events", routing_key=key)
    # TR-9
    channel.basic_qos(prefetch_count=int(os.environ.get("PREFETCH", "10")))
    handler = Handler(channel, InventoryService(store))
    channel.basic_consume(QUEUE, handler.on_message, auto_ack=False)

    def stop(*_):
        # Graceful shutdown: the message in hand completes first.
        connection.add_callback_threadsafe(channel.stop_consuming)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    channel.start_consuming()
    connection.close()


if __name__ == "__main__":
    main()
