package seeds_test

import (
	"context"
	"encoding/json"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	"github.com/fifobox/fifobox/pkg/wire"
)

// ticketing (seeds/003): the inventory consumer written from PRD-005 in
// pika declares TR-3/4/5's exchange, queue (with its dead-letter
// arguments) and DLX itself, keeps consumed_events(event_id, event_type,
// consumed_at), and validates the PRD's event schema strictly. fifobox
// publishes the PRD's envelope with message_id = event_id, timestamp =
// occurred_at (not publish time) and x-retry-count 0. Every event bound
// to inventory.events is applied once and in order; a transient failure is
// retried and applied once; one that keeps failing is retried three times
// (x-retry-count 1, 2, 3), then nacked into inventory.events.dlq through
// ticketing.dlx; a malformed event goes there at once.
func TestTicketingConsumerUnchanged(t *testing.T) {
	t.Parallel()
	py := python(t, "pika", "psycopg")
	ctx := context.Background()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(ctx, `
		CREATE TABLE consumed_events (event_id uuid PRIMARY KEY, event_type text NOT NULL, consumed_at timestamptz NOT NULL);
		CREATE TABLE inventory_applied (id bigserial PRIMARY KEY, event_id uuid, event_type text, aggregate_id text, n int,
			idempotency_key text, retry_count int, message_id text, timestamp_s bigint, content_type text, delivery_mode int)`); err != nil {
		t.Fatal(err)
	}
	prof := load(t, "ticketing")
	v := amqptest.New(t)
	cfg := amqp.Config{URL: v.URL, Topology: amqp.Ticketing(), Wire: mapper(t, prof, wire.TransportRabbitMQ), Logger: quiet}
	prov, err := amqp.NewProfileProvisioner(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := prov.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	start(t, filepath.Join(clientsDir(), "ticketing"), []string{"RABBITMQ_URL=" + v.URL, "DATABASE_URL=" + libpqURL(db.Schema)},
		true, py, "consumer.py")

	type event struct {
		env     envelope.Envelope
		n       int
		inQueue bool // bound to inventory.events
		retries int  // deliveries that fail
		dead    bool
		invalid bool
	}
	occurred := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	var events []*event
	add := func(typ, agg string, n int, payload map[string]any) *event {
		payload["n"] = n
		raw, _ := json.Marshal(payload)
		e := &event{env: envelope.Envelope{ID: uuid.NewString(), Type: typ, OccurredAt: occurred, AggregateType: "ticketing",
			AggregateID: agg, SchemaVersion: 1, Payload: raw}, n: n, inQueue: typ != "order.cancelled"}
		events = append(events, e)
		return e
	}
	for h := 0; h < 3; h++ {
		agg := uuid.NewString()
		for n := 1; n <= 4; n++ {
			add("hold.created", agg, n, map[string]any{"seat": "A1"})
		}
		add("hold.expired", agg, 5, map[string]any{})
	}
	order := uuid.NewString()
	add("order.confirmed", order, 1, map[string]any{})
	add("order.cancelled", order, 2, map[string]any{})
	// Each failure is the last event of its aggregate: the PRD's retry
	// republishes the message behind the queue, so it cannot keep its
	// aggregate's order (the PRD says as much: "ordering guarantees (or lack
	// thereof)"); fifobox's own consumers hold the aggregate instead.
	flaky := add("hold.created", uuid.NewString(), 1, map[string]any{"fail_deliveries": 2})
	flaky.retries = 2
	doomed := add("hold.created", uuid.NewString(), 1, map[string]any{"fail_deliveries": 99})
	doomed.dead = true
	malformed := add("hold.created", uuid.NewString(), 1, map[string]any{"invalid": true})
	malformed.dead, malformed.invalid = true, true

	// TR-6's publisher side: the event row in the service's own outbox
	// table, in the business transaction; fifobox's capture delivers it.
	app := producers(t, db, prof, "ticketing", "outbox.sql")
	for _, e := range events {
		if _, err := app.Pool.Exec(ctx, `INSERT INTO outbox (id, event_type, aggregate_id, payload, created_at) VALUES ($1, $2, $3, $4, $5)`,
			e.env.ID, e.env.Type, e.env.AggregateID, string(e.env.Payload), e.env.OccurredAt); err != nil {
			t.Fatal(err)
		}
	}
	pub, err := amqp.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	dispatch(t, db, pub)

	want := 0
	for _, e := range events {
		if e.inQueue && !e.dead {
			want++
		}
	}
	conn, err := amqp091.Dial(v.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	dlq := map[string]amqp091.Delivery{}
	eventually(t, 2*time.Minute, "every event applied or dead", func() bool {
		for {
			d, ok, err := ch.Get("inventory.events.dlq", true)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				break
			}
			dlq[d.MessageId] = d
		}
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM inventory_applied`).Scan(&n)
		return n >= want && len(dlq) >= 2
	})
	time.Sleep(time.Second) // a duplicate would arrive now

	byID := map[string]*event{}
	for _, e := range events {
		byID[e.env.ID] = e
	}
	rows, err := db.Pool.Query(ctx, `SELECT event_id::text, event_type, aggregate_id, n, idempotency_key, retry_count, message_id,
		timestamp_s, content_type, delivery_mode FROM inventory_applied ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	last := map[string]int{}
	for rows.Next() {
		var id, typ, agg, key, msgID, ctype string
		var n, retry, mode int
		var ts int64
		if err := rows.Scan(&id, &typ, &agg, &n, &key, &retry, &msgID, &ts, &ctype, &mode); err != nil {
			t.Fatal(err)
		}
		e := byID[id]
		if e == nil || seen[id] || !e.inQueue || e.dead {
			t.Fatalf("applied %s (%s): unexpected or twice", id, typ)
		}
		seen[id] = true
		if n != last[agg]+1 {
			t.Errorf("aggregate %s: %d applied after %d", agg, n, last[agg])
		}
		last[agg] = n
		if typ != e.env.Type || key != id || retry != e.retries || msgID != id || ts != occurred.Unix() ||
			ctype != "application/json" || mode != 2 {
			t.Errorf("%s: type %q idempotency_key %q x-retry-count %d message_id %q timestamp %d (occurred %d) %s mode %d",
				id, typ, key, retry, msgID, ts, occurred.Unix(), ctype, mode)
		}
	}
	if len(seen) != want {
		t.Errorf("%d events applied, want %d", len(seen), want)
	}
	var consumed int
	_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM consumed_events`).Scan(&consumed)
	if consumed != want {
		t.Errorf("consumed_events holds %d rows, want %d", consumed, want)
	}
	for _, e := range []*event{doomed, malformed} {
		d, ok := dlq[e.env.ID]
		if !ok {
			t.Errorf("%s is not in inventory.events.dlq (got %d dead letters)", e.env.ID, len(dlq))
			continue
		}
		retries := int64(3)
		if e.invalid {
			retries = 0
		}
		deaths, _ := d.Headers["x-death"].([]any)
		var death amqp091.Table
		if len(deaths) > 0 {
			death, _ = deaths[0].(amqp091.Table)
		}
		if d.Exchange != "ticketing.dlx" || d.RoutingKey != "inventory.events.dlq" || asInt(d.Headers["x-retry-count"]) != retries ||
			death["queue"] != "inventory.events" || death["reason"] != "rejected" {
			t.Errorf("dead letter %s: exchange %q key %q x-retry-count %v x-death %v", e.env.ID, d.Exchange, d.RoutingKey, d.Headers["x-retry-count"], death)
		}
	}
	if len(dlq) != 2 {
		t.Errorf("%d dead letters, want 2", len(dlq))
	}
	// FR-4: "Worker shall mark events as published after successful delivery".
	eventually(t, 30*time.Second, "every outbox row marked published", func() bool {
		var unpublished int
		_ = app.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE NOT published OR published_at IS NULL`).Scan(&unpublished)
		return unpublished == 0
	})
}

// asInt reads an AMQP integer header of any width (-1 if it is none).
func asInt(v any) int64 {
	switch x := v.(type) {
	case int8:
		return int64(x)
	case int16:
		return int64(x)
	case int32:
		return int64(x)
	case int64:
		return x
	case uint8:
		return int64(x)
	case uint16:
		return int64(x)
	case uint32:
		return int64(x)
	}
	return -1
}
