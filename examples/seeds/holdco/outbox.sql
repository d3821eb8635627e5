-- seeds/000 "Outbox schema (Postgres)": Prisma's EventOutbox mapped to
-- event_outbox, with the document's recommended indexes.
CREATE TABLE event_outbox (
    id             uuid PRIMARY KEY,
    group_id       uuid NOT NULL,
    subsidiary_id  uuid,
    aggregate_type text NOT NULL,
    aggregate_id   uuid NOT NULL,
    event_type     text NOT NULL,
    payload        jsonb NOT NULL,
    status         text NOT NULL DEFAULT 'pending',
    available_at   timestamptz NOT NULL DEFAULT now(),
    attempts       int NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ON event_outbox (status, available_at);
CREATE INDEX ON event_outbox (aggregate_type, aggregate_id);
