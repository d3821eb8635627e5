// HoldCo (seeds/000, "Consumer wiring example (amqplib)"), run unchanged
// against fifobox by internal/seeds. Between the two rulers is the
// document's code; its two imports name "../events/*" modules of HoldCo's
// repository, here the files beside this one. Above it is the `prisma`
// instance the document assumes.
import { prisma } from "./prisma.mjs";
process.on("SIGTERM", () => process.exit(0));
// ---------------------------------------------------------------- document
import { connect } from "amqplib";
import { EventInboxService } from "./events/event-inbox.service.mjs";
import { OrderEventsConsumer } from "./events/examples/order-events.consumer.mjs";

const connection = await connect(process.env.RABBITMQ_URL ?? "");
const channel = await connection.createChannel();
await channel.assertQueue("orders.consumer", { durable: true });
await channel.bindQueue("orders.consumer", "holdco.events", "order.*");
channel.prefetch(10);

const inbox = new EventInboxService(prisma);
const consumer = new OrderEventsConsumer(inbox);

await channel.consume("orders.consumer", async (message) => {
  const ok = await consumer.handleMessage(message);
  if (!message) return;
  if (ok) {
    channel.ack(message);
  } else {
    channel.nack(message, false, true);
  }
});
// ---------------------------------------------------------------- document
console.log("ready");
