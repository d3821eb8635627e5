package seeds_test

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	"github.com/fifobox/fifobox/pkg/wire"
)

// holdcoEvent is the HoldCo document's standard envelope.
type holdcoEvent struct {
	EventID       string          `json:"event_id"`
	OccurredAt    string          `json:"occurred_at"`
	AggregateType string          `json:"aggregate_type"`
	AggregateID   string          `json:"aggregate_id"`
	EventType     string          `json:"event_type"`
	GroupID       string          `json:"group_id"`
	SubsidiaryID  *string         `json:"subsidiary_id"`
	Payload       json.RawMessage `json:"payload"`
}

// HoldCo (seeds/000): the document's consumer wiring example, in amqplib,
// declares orders.consumer with {durable: true} and binds it to order.*;
// its OrderEventsConsumer dedupes through event_inbox(consumer_name,
// event_id, processed_at). Every order event reaches it once, in order per
// order, in the document's standard envelope, with message_id = event_id,
// timestamp = when the event occurred and the document's headers
// (x-attempts counting the publishes that failed before). A failed
// delivery is nacked with requeue and applied once on redelivery. A
// message a consumer rejects goes through the DLX holdco.events.dlx with
// routing key <queue>.dlq to its DLQ.
func TestHoldCoConsumerUnchanged(t *testing.T) {
	t.Parallel()
	nodeBin := node(t)
	ctx := context.Background()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(ctx, `
		CREATE TABLE event_inbox (consumer_name text NOT NULL, event_id uuid NOT NULL, processed_at timestamptz NOT NULL,
			UNIQUE (consumer_name, event_id));
		CREATE TABLE orders_applied (id bigserial PRIMARY KEY, event_id uuid, aggregate_id text, event_type text, n int,
			group_id text, subsidiary_id text, routing_key text, message_id text, timestamp_s bigint, headers jsonb, redelivered bool)`); err != nil {
		t.Fatal(err)
	}
	prof := load(t, "holdco")
	v := amqptest.New(t)
	cfg := amqp.Config{URL: v.URL, Topology: amqp.Holdco(), Wire: mapper(t, prof, wire.TransportRabbitMQ), Logger: quiet}
	prov, err := amqp.NewProfileProvisioner(cfg, amqp.Rabbitmqctl{})
	if err != nil {
		t.Fatal(err)
	}
	if err := prov.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(clientsDir(), "holdco")
	env := []string{"RABBITMQ_URL=" + v.URL, "DATABASE_URL=" + libpqURL(db.Schema)}
	start(t, dir, env, true, nodeBin, "consumer.mjs")

	// The producer writes the document's envelope; fifobox reads the event's
	// identity from it through the profile's keys.
	group := uuid.NewString()
	occurred := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	type produced struct {
		ev       holdcoEvent
		attempts int64
	}
	var orders []produced
	var slowPublish, slowDelivery string
	const perOrder = 8
	for o := 0; o < 4; o++ {
		agg := uuid.NewString()
		var sub *string
		if o > 0 {
			s := uuid.NewString()
			sub = &s
		}
		for n := 1; n <= perOrder; n++ {
			typ := "updated"
			switch n {
			case 1:
				typ = "created"
			case perOrder:
				typ = "cancelled"
			}
			payload := map[string]any{"order_no": fmt.Sprintf("ORD-%d", o), "total_amount": "125000.00", "currency": "NGN", "n": n}
			ev := holdcoEvent{EventID: uuid.NewString(), OccurredAt: occurred.Format(time.RFC3339), AggregateType: "order", AggregateID: agg,
				EventType: typ, GroupID: group, SubsidiaryID: sub}
			p := produced{ev: ev}
			switch {
			case o == 1 && n == 3:
				slowPublish, p.attempts = ev.EventID, 2
			case o == 3 && n == perOrder:
				// The last event of its order: the document's consumer
				// requeues a failed message behind the ones already prefetched.
				payload["fail_deliveries"] = 2
				slowDelivery = ev.EventID
			}
			p.ev.Payload, _ = json.Marshal(payload)
			orders = append(orders, p)
		}
	}
	invoice := holdcoEvent{EventID: uuid.NewString(), OccurredAt: occurred.Format(time.RFC3339), AggregateType: "invoice",
		AggregateID: uuid.NewString(), EventType: "paid", GroupID: group, Payload: json.RawMessage(`{"invoice_no":"INV-1"}`)}
	// The document's write path: the domain write and the outbox row in one
	// transaction, into its own event_outbox; fifobox's capture delivers it.
	app := producers(t, db, prof, "holdco", "outbox.sql")
	enqueue := func(ev holdcoEvent) {
		tx, err := app.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO event_outbox (id, group_id, subsidiary_id, aggregate_type, aggregate_id, event_type, payload, created_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8)`, ev.EventID, ev.GroupID, ev.SubsidiaryID, ev.AggregateType, ev.AggregateID, ev.EventType,
			string(ev.Payload), occurred); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	enqueue(invoice)
	for _, p := range orders {
		enqueue(p.ev)
	}
	pub, err := amqp.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	dispatch(t, db, failFirst(pub, 2, slowPublish))

	count := func() int {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM orders_applied`).Scan(&n)
		return n
	}
	eventually(t, 2*time.Minute, "every order event applied", func() bool { return count() >= len(orders) })
	time.Sleep(time.Second) // a duplicate would arrive now
	if n := count(); n != len(orders) {
		t.Fatalf("%d applications of %d order events", n, len(orders))
	}

	rows, err := db.Pool.Query(ctx, `SELECT event_id::text, aggregate_id, event_type, n, group_id, coalesce(subsidiary_id, ''), routing_key,
		message_id, timestamp_s, headers, redelivered FROM orders_applied ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]produced{}
	for _, p := range orders {
		byID[p.ev.EventID] = p
	}
	lastN := map[string]int{}
	seen := map[string]bool{}
	for rows.Next() {
		var id, agg, typ, grp, sub, key, msgID string
		var n int
		var ts int64
		var headers map[string]any
		var redelivered bool
		if err := rows.Scan(&id, &agg, &typ, &n, &grp, &sub, &key, &msgID, &ts, &headers, &redelivered); err != nil {
			t.Fatal(err)
		}
		p, ok := byID[id]
		if !ok || seen[id] {
			t.Fatalf("applied %s: unknown or twice", id)
		}
		seen[id] = true
		if n != lastN[agg]+1 {
			t.Errorf("order %s: event %d applied after %d", agg, n, lastN[agg])
		}
		lastN[agg] = n
		wantSub := ""
		if p.ev.SubsidiaryID != nil {
			wantSub = *p.ev.SubsidiaryID
		}
		if typ != p.ev.EventType || grp != group || sub != wantSub || key != "order."+p.ev.EventType || msgID != id || ts != occurred.Unix() {
			t.Errorf("%s: type %q group %q subsidiary %q key %q message_id %q timestamp %d (occurred %d)", id, typ, grp, sub, key, msgID, ts, occurred.Unix())
		}
		want := map[string]any{"x-event-id": id, "x-aggregate-type": "order", "x-aggregate-id": agg, "x-group-id": group,
			"x-event-type": p.ev.EventType, "x-attempts": float64(p.attempts)}
		if wantSub != "" {
			want["x-subsidiary-id"] = wantSub
		}
		if len(headers) != len(want) {
			t.Errorf("%s: headers %v, want %v", id, headers, want)
		}
		for k, w := range want {
			if headers[k] != w {
				t.Errorf("%s: header %s = %v, want %v", id, k, headers[k], w)
			}
		}
		if redelivered != (id == slowDelivery) {
			t.Errorf("%s: redelivered %v", id, redelivered)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	// The document's status column tells the truth: every row published.
	eventually(t, 30*time.Second, "every event_outbox row published", func() bool {
		var published int
		_ = app.Pool.QueryRow(ctx, `SELECT count(*) FROM event_outbox WHERE status = 'published'`).Scan(&published)
		return published == len(orders)+1
	})
	var inbox int
	_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM event_inbox WHERE consumer_name = 'orders.consumer'`).Scan(&inbox)
	if inbox != len(orders) {
		t.Errorf("event_inbox holds %d rows, want %d", inbox, len(orders))
	}

	// Dead-lettering as the document says: rejected without requeue, a
	// message goes through holdco.events.dlx with routing key <queue>.dlq.
	lines := start(t, dir, env, false, nodeBin, "dead_letter.mjs", "analytics.ingest", "erp.sync").wait(2 * time.Minute)
	if len(lines) != 2 {
		t.Fatalf("dead_letter.mjs printed %q", lines)
	}
	for i, q := range []string{"analytics.ingest", "erp.sync"} {
		var raw map[string]string
		if err := json.Unmarshal([]byte(lines[i]), &raw); err != nil {
			t.Fatal(err)
		}
		if raw["queue"] != q || raw["exchange"] != "holdco.events.dlx" || raw["routing_key"] != q+".dlq" ||
			raw["death_queue"] != q || raw["death_reason"] != "rejected" {
			t.Errorf("dead letter of %s: %v", q, raw)
		}
		if q == "erp.sync" && raw["event_id"] != invoice.EventID {
			t.Errorf("erp.sync's dead letter is %s, want the invoice event (erp.sync binds invoice.*)", raw["event_id"])
		}
	}
}
