// Package readmodel is fifobox's example consumer: it keeps the
// orders_read_model table current from order events. It shows the pattern to
// copy: a pure Apply function over (tx, envelope) that the consumers' handlers run
// inside the inbox transaction, so each event changes the table exactly once.
package readmodel

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/inbox"
)

// OrderEvent is the payload of order.created, order.paid and order.shipped.
type OrderEvent struct {
	OrderID     string `json:"order_id"`
	CustomerID  string `json:"customer_id"`
	AmountCents int64  `json:"amount_cents"`
	Currency    string `json:"currency"`
}

// The status only moves forward: an event older than the row's last
// sequence (a message redriven from the DLQ after later events of its order
// were applied, or a replay) still counts in event_count and fills the
// fields only it carries, but does not set the status back.
const (
	sqlCreated = `INSERT INTO orders_read_model (order_id, customer_id, amount_cents, currency, status, last_sequence, event_count)
VALUES ($1, $2, $3, $4, 'created', $5, 1)
ON CONFLICT (order_id) DO UPDATE SET customer_id = EXCLUDED.customer_id, amount_cents = EXCLUDED.amount_cents,
    currency = EXCLUDED.currency,
    status = CASE WHEN EXCLUDED.last_sequence > orders_read_model.last_sequence THEN EXCLUDED.status ELSE orders_read_model.status END,
    last_sequence = GREATEST(orders_read_model.last_sequence, EXCLUDED.last_sequence),
    event_count = orders_read_model.event_count + 1, updated_at = now()`
	sqlStatus = `INSERT INTO orders_read_model (order_id, status, last_sequence, event_count)
VALUES ($1, $2, $3, 1)
ON CONFLICT (order_id) DO UPDATE SET
    status = CASE WHEN EXCLUDED.last_sequence > orders_read_model.last_sequence THEN EXCLUDED.status ELSE orders_read_model.status END,
    last_sequence = GREATEST(orders_read_model.last_sequence, EXCLUDED.last_sequence),
    event_count = orders_read_model.event_count + 1, updated_at = now()`
)

// sqlSetup creates the read model (the demo's table, not fifobox's: no
// migration creates it) and lets fifobox's consumer role write it.
const sqlSetup = `
DO $setup$
BEGIN
    -- One found anywhere on the search_path is the demo's (an install from
    -- before fifobox had its own schema keeps it in public): another one in
    -- the first schema would shadow it.
    IF to_regclass('orders_read_model') IS NULL THEN
        CREATE TABLE orders_read_model (
            order_id      text        PRIMARY KEY,
            customer_id   text        NOT NULL DEFAULT '',
            amount_cents  bigint      NOT NULL DEFAULT 0,
            currency      text        NOT NULL DEFAULT '',
            status        text        NOT NULL,
            last_sequence bigint      NOT NULL,
            event_count   integer     NOT NULL,
            updated_at    timestamptz NOT NULL DEFAULT now()
        );
    END IF;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'fifobox_consumer') THEN
        GRANT SELECT, INSERT, UPDATE, DELETE ON orders_read_model TO fifobox_consumer;
    END IF;
END
$setup$`

// Setup creates the orders_read_model table if none is on the search_path
// (in the connection's current schema) and grants fifobox_consumer its use: what the
// demo (make local, the example consumer) runs before its consumers start.
// It needs the right to create tables there; an existing table is kept as
// it is.
func Setup(ctx context.Context, db interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}) error {
	if _, err := db.Exec(ctx, sqlSetup); err != nil {
		return fmt.Errorf("readmodel: create orders_read_model: %w", err)
	}
	return nil
}

// Ensure is Setup when the table is missing (a consumer's own role may
// not create tables: an existing table needs no rights beyond its use).
func Ensure(ctx context.Context, db interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}) error {
	var exists bool
	if err := db.QueryRow(ctx, `SELECT to_regclass('orders_read_model') IS NOT NULL`).Scan(&exists); err != nil {
		return fmt.Errorf("readmodel: look for orders_read_model: %w", err)
	}
	if exists {
		return nil
	}
	if err := Setup(ctx, db); err != nil {
		return fmt.Errorf("the example consumer's table is missing and cannot be created here (create it as the schema's owner: readmodel.Setup, or the redrive function's migrate): %w", err)
	}
	return nil
}

// Projection is the consumer whose side effect is the read model.
const Projection = "orders-projection"

// Apply updates the read model from one event. Non-order events and unknown
// order event types are ignored (still recorded in the inbox). A payload
// that does not parse is a permanent error: retrying cannot fix it.
func Apply(ctx context.Context, tx pgx.Tx, e envelope.Envelope) error {
	if e.AggregateType != "order" {
		return nil
	}
	var p OrderEvent
	if err := json.Unmarshal(e.Payload, &p); err != nil {
		return envelope.Permanent(fmt.Errorf("order event %s: payload: %w", e.ID, err))
	}
	if p.OrderID == "" {
		p.OrderID = e.AggregateID
	}
	var err error
	switch e.Type {
	case "order.created":
		_, err = tx.Exec(ctx, sqlCreated, p.OrderID, p.CustomerID, p.AmountCents, p.Currency, e.Sequence)
	case "order.paid":
		_, err = tx.Exec(ctx, sqlStatus, p.OrderID, "paid", e.Sequence)
	case "order.shipped":
		_, err = tx.Exec(ctx, sqlStatus, p.OrderID, "shipped", e.Sequence)
	default:
		return nil
	}
	if err != nil {
		// Named by event id, never by order id: the error reaches logs and
		// the DLQ's reason attribute, and order ids may carry personal data.
		return fmt.Errorf("apply %s (event %s, sequence %d): %w", e.Type, e.ID, e.Sequence, err)
	}
	return nil
}

// Acknowledge is the side effect of consumers that only need the event
// recorded (the inbox row is the record), such as the demo's audit and
// shipping consumers. Replace it with your own Apply.
func Acknowledge(context.Context, pgx.Tx, envelope.Envelope) error { return nil }

// ForConsumer returns the example side effect of a default-topology
// consumer: orders-projection keeps orders_read_model; the others only
// acknowledge. One binary serves every consumer function this way; a real
// service would usually build one function per side effect.
func ForConsumer(name string) inbox.Apply {
	if name == Projection {
		return Apply
	}
	return Acknowledge
}
