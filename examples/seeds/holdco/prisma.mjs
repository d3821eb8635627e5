// The HoldCo document's consumer example "assumes a PrismaService instance
// named prisma". This is the smallest stand-in that runs here: node-postgres
// with Prisma's interactive-transaction shape ($transaction(fn) gives fn a
// client whose queries run in one transaction). DATABASE_URL names the
// database (and schema, through libpq options).
import pg from "pg";

const pool = new pg.Pool({ connectionString: process.env.DATABASE_URL, max: 4 });

export const prisma = {
  async $transaction(fn) {
    const client = await pool.connect();
    try {
      await client.query("BEGIN");
      const out = await fn({ query: (text, values) => client.query(text, values) });
      await client.query("COMMIT");
      return out;
    } catch (err) {
      await client.query("ROLLBACK").catch(() => {});
      throw err;
    } finally {
      client.release();
    }
  },
  $disconnect: () => pool.end(),
};
