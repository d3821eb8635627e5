package seeds_test

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
	"github.com/fifobox/fifobox/pkg/wire"
)

// corewrite (seeds/002): the guide's OutboxSubscriber (amqplib) asserts
// the fanout exchange corewrite.fanout and its queue named after the
// subscriber ({durable: true, autoDelete: false}), prefetch 1, and its
// handlers read OUTBOX_ID, EVENT_TYPE, AGGREGATE_TYPE, AGGREGATE_ID and
// PAYLOAD and dedupe by OUTBOX_ID. Both subscribers get every event once,
// in order. The guide's ResilientSubscriber retries a failing event three
// times, then publishes it to the direct exchange corewrite.dlq keyed by
// its queue name, where the profile's queue corewrite.dlq holds it.
func TestCorewriteSubscribersUnchanged(t *testing.T) {
	t.Parallel()
	nodeBin := node(t)
	ctx := context.Background()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(ctx, `
		CREATE TABLE processed (queue text, outbox_id text, PRIMARY KEY (queue, outbox_id));
		CREATE TABLE indexed (id bigserial PRIMARY KEY, queue text, outbox_id text, event_type text, aggregate_type text, aggregate_id text, n int)`); err != nil {
		t.Fatal(err)
	}
	prof := load(t, "corewrite")
	v := amqptest.New(t)
	cfg := amqp.Config{URL: v.URL, Topology: amqp.Corewrite(), Wire: mapper(t, prof, wire.TransportRabbitMQ), Logger: quiet}
	prov, err := amqp.NewProfileProvisioner(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := prov.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(clientsDir(), "corewrite")
	env := []string{"RABBITMQ_URL=" + v.URL, "DATABASE_URL=" + libpqURL(db.Schema)}
	start(t, dir, env, true, nodeBin, "subscriber.cjs", "search-indexer", "resilient")
	start(t, dir, env, true, nodeBin, "subscriber.cjs", "cache-invalidator")

	type event struct {
		id, agg, typ string
		n            int
		poison       bool
	}
	var events []event
	for p := 1; p <= 3; p++ {
		agg := fmt.Sprintf("PRD-%d", p)
		for n := 1; n <= 6; n++ {
			typ := "ProductUpdated"
			switch n {
			case 1:
				typ = "ProductCreated"
			case 6:
				typ = "ProductDeleted"
			}
			events = append(events, event{id: uuid.NewString(), agg: agg, typ: typ, n: n})
		}
	}
	poison := event{id: uuid.NewString(), agg: "PRD-9", typ: "ProductCreated", n: 1, poison: true}
	events = append(events, poison)
	app := producers(t, db, prof, "corewrite", "outbox.sql")
	for _, e := range events {
		pl := map[string]any{"PRD_ID": e.agg, "XPRD01": "Widget", "n": e.n}
		if e.poison {
			pl["fail_in"] = "search-indexer"
		}
		payload, _ := json.Marshal(pl)
		// The guide's write: update TB_ANAG_{DIM}00, insert the OUTBOX event,
		// commit; fifobox's capture delivers the OUTBOX row.
		if _, err := app.Pool.Exec(ctx, `INSERT INTO outbox (outbox_id, event_type, aggregate_type, aggregate_id, payload) VALUES ($1, $2, $3, $4, $5)`,
			e.id, e.typ, "PRD", e.agg, string(payload)); err != nil {
			t.Fatal(err)
		}
	}
	pub, err := amqp.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	dispatch(t, db, pub)

	count := func(queue string) int {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM indexed WHERE queue = $1`, queue).Scan(&n)
		return n
	}
	eventually(t, 2*time.Minute, "both subscribers applied their events", func() bool {
		return count("search-indexer") >= len(events)-1 && count("cache-invalidator") >= len(events)-1
	})

	// The poison event: three attempts (2 s and 4 s apart), then the
	// guide's sendToDeadLetterQueue; the profile's corewrite.dlq queue holds it.
	conn, err := amqp091.Dial(v.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	var dead amqp091.Delivery
	eventually(t, time.Minute, "the poison event in corewrite.dlq", func() bool {
		d, ok, err := ch.Get("corewrite.dlq", true)
		if err != nil {
			t.Fatal(err)
		}
		dead = d
		return ok
	})
	var body map[string]any
	_ = json.Unmarshal(dead.Body, &body)
	if body["OUTBOX_ID"] != poison.id || dead.Exchange != "corewrite.dlq" || dead.RoutingKey != "search-indexer" ||
		dead.Headers["x-original-queue"] != "search-indexer" || dead.Headers["x-error"] != "Max retries exceeded" {
		t.Errorf("dead letter: exchange %q key %q headers %v body %s", dead.Exchange, dead.RoutingKey, dead.Headers, dead.Body)
	}
	time.Sleep(time.Second) // a duplicate would arrive now

	for _, q := range []string{"search-indexer", "cache-invalidator"} {
		rows, err := db.Pool.Query(ctx, `SELECT outbox_id, event_type, aggregate_type, aggregate_id, n FROM indexed WHERE queue = $1 ORDER BY id`, q)
		if err != nil {
			t.Fatal(err)
		}
		byID := map[string]event{}
		for _, e := range events {
			byID[e.id] = e
		}
		seen := map[string]bool{}
		last := map[string]int{}
		for rows.Next() {
			var id, typ, aggType, agg string
			var n int
			if err := rows.Scan(&id, &typ, &aggType, &agg, &n); err != nil {
				t.Fatal(err)
			}
			e, ok := byID[id]
			if !ok || seen[id] {
				t.Fatalf("%s applied %s: unknown or twice", q, id)
			}
			seen[id] = true
			if typ != e.typ || aggType != "PRD" || agg != e.agg || n != last[agg]+1 {
				t.Errorf("%s: %s applied as %s %s/%s n=%d after %d", q, id, typ, aggType, agg, n, last[agg])
			}
			last[agg] = n
		}
		want := len(events)
		if q == "search-indexer" {
			want-- // the poison event went to the DLQ
		} else if !seen[poison.id] {
			t.Errorf("cache-invalidator did not apply %s (it does not fail)", poison.id)
		}
		if len(seen) != want {
			t.Errorf("%s applied %d events, want %d", q, len(seen), want)
		}
	}
}
