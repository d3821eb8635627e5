-- +goose Up

-- The demo's read model is the example consumer's table, not fifobox's
-- (issue 29): pkg/readmodel.Setup creates it where the demo runs (make
-- local, the example consumer), and 00003 no longer leaves it in every
-- user's database. A deployment whose table holds rows, or that has built
-- on it (a view, a foreign key), keeps it untouched: only an empty table
-- nothing depends on is dropped. The lock makes the emptiness check and the
-- drop one step against a consumer writing at the same time.
-- +goose StatementBegin
DO $demo$
BEGIN
    IF to_regclass('orders_read_model') IS NULL
       OR (SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE c.oid = to_regclass('orders_read_model')) <> current_schema() THEN
        RETURN;
    END IF;
    LOCK TABLE orders_read_model IN ACCESS EXCLUSIVE MODE;
    IF EXISTS (SELECT 1 FROM orders_read_model) THEN
        RETURN;
    END IF;
    BEGIN
        DROP TABLE orders_read_model;
    EXCEPTION WHEN dependent_objects_still_exist THEN
        NULL; -- something of the user's uses it: it stays
    END;
END
$demo$;
-- +goose StatementEnd

-- +goose Down
-- 00003's table again, for 00003's own Down.
CREATE TABLE IF NOT EXISTS orders_read_model (
    order_id      text        PRIMARY KEY,
    customer_id   text        NOT NULL DEFAULT '',
    amount_cents  bigint      NOT NULL DEFAULT 0,
    currency      text        NOT NULL DEFAULT '',
    status        text        NOT NULL,
    last_sequence bigint      NOT NULL,
    event_count   integer     NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
