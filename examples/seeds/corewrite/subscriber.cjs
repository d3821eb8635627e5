// corewrite (seeds/002, "Outbox Subscribers"), run unchanged against fifobox
// by internal/seeds. The classes between the rulers are the guide's
// OutboxSubscriber and ResilientSubscriber, as written. Below them, the
// guide's idempotent handler pattern ("Idempotency Strategies 1": skip if
// OUTBOX_ID was processed, process, mark processed) with the guide's
// search-indexer switch on EVENT_TYPE; its Redis and Elasticsearch are not
// on this machine, so the processed set and the index are tables in
// PostgreSQL (DATABASE_URL).
//
//   node subscriber.cjs <queue> [resilient]
//
// prints "ready" once consuming. An event whose PAYLOAD has "fail_in":
// "<queue>" fails that queue's handler every time (a poison event).
const { Client } = require('pg');
// ---------------------------------------------------------------- guide
const amqp = require('amqplib');

class OutboxSubscriber {
constructor(queueName, exchangeName = 'corewrite.fanout') {
this.queueName = queueName;
this.exchangeName = exchangeName;
this.connection = null;
this.channel = null;
}

async connect() {
// Connect to RabbitMQ
this.connection = await amqp.connect(process.env.RABBITMQ_URL);
this.channel = await this.connection.createChannel();

// Assert exchange
await this.channel.assertExchange(this.exchangeName, 'fanout', {
durable: true
});

// Create queue
const queue = await this.channel.assertQueue(this.queueName, {
durable: true,
autoDelete: false
});

// Bind queue to exchange
await this.channel.bindQueue(queue.queue, this.exchangeName, '');

// Set prefetch (process one message at a time)
await this.channel.prefetch(1);

console.log(`[${this.queueName}] Waiting for events...`);
}

async subscribe(handler) {
await this.channel.consume(this.queueName, async (msg) => {
if (!msg) return;

try {
const event = JSON.parse(msg.content.toString());

console.log(`[${this.queueName}] Processing event:`, event.EVENT_TYPE);

// Handle event (idempotent)
await handler(event);

// Acknowledge message
this.channel.ack(msg);

console.log(`[${this.queueName}] Event processed successfully`);
} catch (error) {
console.error(`[${this.queueName}] Error processing event:`, error);

// Reject and requeue (will retry)
this.channel.nack(msg, false, true);
}
});
}

async close() {
await this.channel.close();
await this.connection.close();
}
}

class ResilientSubscriber extends OutboxSubscriber {
async subscribe(handler, maxRetries = 3) {
await this.channel.consume(this.queueName, async (msg) => {
if (!msg) return;

let retryCount = 0;
let success = false;

while (retryCount < maxRetries && !success) {
try {
const event = JSON.parse(msg.content.toString());

await handler(event);

this.channel.ack(msg);
success = true;
} catch (error) {
retryCount++;

console.error(
`[${this.queueName}] Error (attempt ${retryCount}/${maxRetries}):`,
error.message
);

if (retryCount >= maxRetries) {
// Max retries exceeded - move to dead letter queue
await this.sendToDeadLetterQueue(msg);
this.channel.ack(msg);
} else {
// Wait before retry (exponential backoff)
await this.sleep(Math.pow(2, retryCount) * 1000);
}
}
}
});
}

async sendToDeadLetterQueue(msg) {
const dlqExchange = 'corewrite.dlq';
const event = JSON.parse(msg.content.toString());

await this.channel.assertExchange(dlqExchange, 'direct', { durable: true });

await this.channel.publish(
dlqExchange,
this.queueName,
msg.content,
{
persistent: true,
headers: {
'x-original-queue': this.queueName,
'x-failed-at': new Date().toISOString(),
'x-error': 'Max retries exceeded'
}
}
);

console.log(`[${this.queueName}] Sent to DLQ:`, event.OUTBOX_ID);
}

sleep(ms) {
return new Promise(resolve => setTimeout(resolve, ms));
}
}
// ---------------------------------------------------------------- guide

// The guide's idempotency strategy 1 over PostgreSQL instead of Redis.
const db = new Client({ connectionString: process.env.DATABASE_URL });

async function isProcessed(outboxId, queue) {
  const r = await db.query('SELECT 1 FROM processed WHERE queue = $1 AND outbox_id = $2', [queue, outboxId]);
  return r.rowCount === 1;
}

async function markProcessed(outboxId, queue) {
  await db.query('INSERT INTO processed (queue, outbox_id) VALUES ($1, $2)', [queue, outboxId]);
}

// The guide's SearchIndexer.handleEvent shape: dedupe by OUTBOX_ID, switch on
// EVENT_TYPE, mark processed. "Indexing" records what a consumer saw.
function handlerFor(queue) {
  return async function handleEvent(event) {
    const { EVENT_TYPE, AGGREGATE_TYPE, AGGREGATE_ID, PAYLOAD } = event;

    if (await isProcessed(event.OUTBOX_ID, queue)) {
      console.log('Event already processed, skipping');
      return;
    }
    if (PAYLOAD && PAYLOAD.fail_in === queue) {
      throw new Error('poison event');
    }
    switch (EVENT_TYPE) {
      case 'ProductCreated':
      case 'ProductUpdated':
      case 'ProductDeleted':
        await db.query('INSERT INTO indexed (queue, outbox_id, event_type, aggregate_type, aggregate_id, n) VALUES ($1, $2, $3, $4, $5, $6)',
          [queue, event.OUTBOX_ID, EVENT_TYPE, AGGREGATE_TYPE, AGGREGATE_ID, PAYLOAD.n]);
        break;
      default:
        console.log(`Unknown event type: ${EVENT_TYPE}`);
    }
    await markProcessed(event.OUTBOX_ID, queue);
  };
}

async function main() {
  const [queue, kind] = process.argv.slice(2);
  await db.connect();
  const subscriber = kind === 'resilient' ? new ResilientSubscriber(queue) : new OutboxSubscriber(queue);
  await subscriber.connect();
  await subscriber.subscribe(handlerFor(queue));
  process.stdout.write('ready\n');
  process.on('SIGTERM', async () => {
    await subscriber.close().catch(() => {});
    process.exit(0);
  });
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
