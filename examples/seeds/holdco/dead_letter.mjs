// HoldCo's dead-lettering (seeds/000, "RabbitMQ topology > Dead-lettering"):
// each queue has the DLX holdco.events.dlx (direct) and the dead-letter
// routing key <queue>.dlq. This rejects, without requeue, one message of
// each queue named in the arguments, as a consumer giving up on it would,
// then reads <queue>.dlq and prints where the dead letter arrived from, one
// JSON line per queue.
import { connect } from "amqplib";

const connection = await connect(process.env.RABBITMQ_URL ?? "");
const channel = await connection.createChannel();
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
for (const queue of process.argv.slice(2)) {
  await channel.assertQueue(queue, { durable: true });
  let msg = false;
  for (let i = 0; i < 100 && !msg; i++) {
    msg = await channel.get(queue, { noAck: false });
    if (!msg) await sleep(100);
  }
  if (!msg) throw new Error(`no message in ${queue}`);
  channel.nack(msg, false, false);
  let dead = false;
  for (let i = 0; i < 100 && !dead; i++) {
    dead = await channel.get(`${queue}.dlq`, { noAck: true });
    if (!dead) await sleep(100);
  }
  if (!dead) throw new Error(`nothing arrived in ${queue}.dlq`);
  const death = dead.properties.headers["x-death"]?.[0] ?? {};
  console.log(JSON.stringify({
    queue, exchange: dead.fields.exchange, routing_key: dead.fields.routingKey,
    event_id: JSON.parse(dead.content.toString()).event_id,
    death_queue: death.queue, death_reason: death.reason,
  }));
}
await connection.close();
