// OrderEventsConsumer, the HoldCo document's example consumer of order
// events (its wiring is in consumer.mjs, copied from the document). It
// reads the document's standard envelope, dedupes by event_id through
// EventInboxService, and applies the side effect: here, recording the event
// in orders_applied, with the headers the document says the publisher sets.
//
// It applies one message at a time: the wiring's prefetch(10) hands it up to
// ten at once, and events of one order must apply in order.
//
// Test hook (not in the document): an event whose payload has
// "fail_deliveries": k fails its first k deliveries (handleMessage returns
// false, so the wiring nacks it with requeue).
export class OrderEventsConsumer {
  constructor(inbox) {
    this.inbox = inbox;
    this.chain = Promise.resolve();
    this.failures = new Map();
  }

  handleMessage(message) {
    const run = this.chain.then(() => this.apply(message));
    this.chain = run.catch(() => {});
    return run;
  }

  async apply(message) {
    if (!message) return false;
    let event;
    try {
      event = JSON.parse(message.content.toString());
    } catch {
      return false;
    }
    const failing = event.payload?.fail_deliveries ?? 0;
    const seen = this.failures.get(event.event_id) ?? 0;
    if (seen < failing) {
      this.failures.set(event.event_id, seen + 1);
      return false;
    }
    try {
      await this.inbox.process("orders.consumer", event.event_id, async (tx) => {
        await tx.query(
          `INSERT INTO orders_applied (event_id, aggregate_id, event_type, n, group_id, subsidiary_id, routing_key, message_id, timestamp_s, headers, redelivered)
           VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)`,
          [event.event_id, event.aggregate_id, event.event_type, event.payload?.n ?? null, event.group_id, event.subsidiary_id,
            message.fields.routingKey, message.properties.messageId, message.properties.timestamp ?? null,
            JSON.stringify(message.properties.headers ?? {}), message.fields.redelivered],
        );
      });
      return true;
    } catch (err) {
      console.error("orders.consumer:", err.message);
      return false;
    }
  }
}
