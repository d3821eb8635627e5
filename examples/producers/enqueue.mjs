// Enqueue from TypeScript/JavaScript with node-postgres: the business row and
// its event in one transaction. Usage (what the polyglot test runs):
//
//   DATABASE_URL=postgres://... node enqueue.mjs <aggregate-id>... 
//
// For each aggregate it commits FIFOBOX_EVENTS transactions (default 20),
// each inserting a row into poly_business and one event, then one transaction
// that it rolls back: that event must never exist. It prints one JSON line
// per committed event: {"event_id": ..., "aggregate_id": ..., "sequence": ...}.
import pg from "pg";

const client = new pg.Client({ connectionString: process.env.DATABASE_URL });
await client.connect();
const perAggregate = Number(process.env.FIFOBOX_EVENTS ?? 20);

async function enqueueOrder(aggregateId, n, commit) {
  await client.query("BEGIN");
  try {
    await client.query("INSERT INTO poly_business (producer, aggregate_id, n) VALUES ('node', $1, $2)", [aggregateId, n]);
    const { rows } = await client.query(
      `SELECT event_id, sequence FROM fifobox_enqueue(
         aggregate_type => 'order', aggregate_id => $1, type => 'order.updated',
         payload => $2, tenant_id => 'acme', occurred_at => $3)`,
      [aggregateId, JSON.stringify({ producer: "node", n }), new Date()],
    );
    if (!commit) {
      await client.query("ROLLBACK");
      return null;
    }
    await client.query("COMMIT");
    return rows[0];
  } catch (err) {
    await client.query("ROLLBACK");
    // A validation error names the field: err.code (SQLSTATE) and err.column.
    throw new Error(`enqueue ${aggregateId}: ${err.message} (SQLSTATE ${err.code}, field ${err.column})`);
  }
}

for (let n = 0; n < perAggregate; n++) {
  for (const aggregateId of process.argv.slice(2)) {
    const row = await enqueueOrder(aggregateId, n, true);
    console.log(JSON.stringify({ event_id: row.event_id, aggregate_id: aggregateId, sequence: Number(row.sequence) }));
  }
}
for (const aggregateId of process.argv.slice(2)) {
  await enqueueOrder(aggregateId, -1, false);
}
// A bad event is refused with its field named, and nothing is written.
try {
  await enqueueOrder("bad id with spaces", 0, true);
  throw new Error("an invalid aggregate_id was accepted");
} catch (err) {
  if (!/field aggregate_id/.test(err.message)) throw err;
}
await client.end();
