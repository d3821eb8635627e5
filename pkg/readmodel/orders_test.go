package readmodel_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/readmodel"
)

type row struct {
	customer, currency, status string
	amount, lastSeq            int64
	events                     int
}

func order(t *testing.T, id, typ string, seq int64, p readmodel.OrderEvent) envelope.Envelope {
	t.Helper()
	e, err := envelope.New(typ, "order", id, p)
	if err != nil {
		t.Fatal(err)
	}
	e.Sequence = seq
	return e
}

func apply(t *testing.T, db *pgtest.DB, e envelope.Envelope) error {
	t.Helper()
	return pgx.BeginFunc(context.Background(), db.Pool, func(tx pgx.Tx) error { return readmodel.Apply(context.Background(), tx, e) })
}

func read(t *testing.T, db *pgtest.DB, id string) row {
	t.Helper()
	var r row
	err := db.Pool.QueryRow(context.Background(), `SELECT customer_id, currency, status, amount_cents, last_sequence, event_count
FROM orders_read_model WHERE order_id = $1`, id).Scan(&r.customer, &r.currency, &r.status, &r.amount, &r.lastSeq, &r.events)
	if err != nil {
		t.Fatalf("read order %s: %v", id, err)
	}
	return r
}

// Whatever order an order's events are applied in (FIFO delivery, or an
// event redriven from the DLQ after later ones were applied), the row ends
// up the same: the newest status, the created event's fields, every event
// counted once.
func TestApplyInAnyOrderEndsInTheSameState(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	seqs := map[string]int64{"created": 1, "paid": 2, "shipped": 3}
	want := row{customer: "c-7", currency: "EUR", status: "shipped", amount: 1250, lastSeq: 3, events: 3}
	for i, steps := range [][]string{
		{"created", "paid", "shipped"}, // FIFO
		{"created", "shipped", "paid"}, // paid redriven
		{"paid", "shipped", "created"}, // created redriven
		{"paid", "created", "shipped"},
		{"shipped", "created", "paid"},
		{"shipped", "paid", "created"},
	} {
		t.Run(fmt.Sprint(steps), func(t *testing.T) {
			id := fmt.Sprintf("o-%d", i)
			for _, step := range steps {
				p := readmodel.OrderEvent{OrderID: id}
				if step == "created" {
					p = readmodel.OrderEvent{OrderID: id, CustomerID: "c-7", AmountCents: 1250, Currency: "EUR"}
				}
				if err := apply(t, db, order(t, id, "order."+step, seqs[step], p)); err != nil {
					t.Fatalf("apply %s: %v", step, err)
				}
			}
			if got := read(t, db, id); got != want {
				t.Errorf("row %+v, want %+v", got, want)
			}
		})
	}
}

func TestApplyIgnoresOtherEventsAndRejectsBadPayloads(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	other, _ := envelope.New("customer.created", "customer", "c-1", map[string]string{"name": "x"})
	unknown := order(t, "o-x", "order.refunded", 4, readmodel.OrderEvent{OrderID: "o-x"})
	for _, e := range []envelope.Envelope{other, unknown} {
		if err := apply(t, db, e); err != nil {
			t.Errorf("%s: %v, want ignored", e.Type, err)
		}
	}
	bad := order(t, "o-y", "order.created", 1, readmodel.OrderEvent{})
	bad.Payload = []byte(`{"amount_cents":"twelve"}`)
	if err := apply(t, db, bad); !envelope.IsPermanent(err) {
		t.Errorf("bad payload: %v, want a permanent error", err)
	}
	var n int
	if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM orders_read_model`).Scan(&n); err != nil || n != 0 {
		t.Errorf("read model rows %d (%v), want 0", n, err)
	}
}

// The read model's errors reach logs and the DLQ's reason attribute: they
// name the event, never the order id (aggregate ids may carry personal data).
func TestApplyErrorsDoNotNameTheOrder(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), `ALTER TABLE orders_read_model ADD CONSTRAINT no_euro CHECK (currency <> 'EUR')`); err != nil {
		t.Fatal(err)
	}
	e := order(t, "customer-4711-order", "order.created", 1, readmodel.OrderEvent{OrderID: "customer-4711-order", Currency: "EUR"})
	err := apply(t, db, e)
	if err == nil {
		t.Fatal("want the check violation")
	}
	if strings.Contains(err.Error(), "4711") || !strings.Contains(err.Error(), e.ID) {
		t.Fatalf("error %q: want the event id and no order id", err)
	}
}
