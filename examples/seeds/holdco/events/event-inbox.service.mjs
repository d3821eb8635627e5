// EventInboxService, as the HoldCo document describes it (Idempotency >
// Consumer idempotency): a consumer inserts (consumer_name, event_id) into
// event_inbox before applying side effects; if the insert fails, it skips.
// Here the insert and the side effect share one transaction, so a crash
// between them cannot mark an event processed without its effect.
export class EventInboxService {
  constructor(prisma) {
    this.prisma = prisma;
  }

  // process runs effect(tx) once per (consumerName, eventId): it returns
  // false, without calling effect, when the inbox already holds the pair.
  async process(consumerName, eventId, effect) {
    return this.prisma.$transaction(async (tx) => {
      const r = await tx.query(
        `INSERT INTO event_inbox (consumer_name, event_id, processed_at) VALUES ($1, $2, now())
         ON CONFLICT (consumer_name, event_id) DO NOTHING`,
        [consumerName, eventId],
      );
      if (r.rowCount === 0) return false;
      await effect(tx);
      return true;
    });
  }
}
