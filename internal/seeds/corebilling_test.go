package seeds_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go"
	"github.com/oklog/ulid/v2"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	fifonats "github.com/fifobox/fifobox/pkg/transport/nats"
	"github.com/fifobox/fifobox/pkg/wire"
)

// privateNATS starts a JetStream server of the test's own: corebilling's
// subjects ("subscription.created") have no prefix, and subjects are
// shared by every stream of a server.
func privateNATS(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("nats-server")
	if err != nil {
		if bin, err = exec.LookPath("/usr/sbin/nats-server"); err != nil {
			missing(t, "nats-server (scripts/ensure-nats.sh installs it)")
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	cmd := exec.Command(bin, "-a", "127.0.0.1", "-p", fmt.Sprint(port), "-js", "-sd", t.TempDir())
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	url := fmt.Sprintf("nats://127.0.0.1:%d", port)
	eventually(t, 30*time.Second, "the private nats-server", func() bool {
		nc, err := nats.Connect(url)
		if err != nil {
			return false
		}
		nc.Close()
		return true
	})
	return url
}

// billingEvent is eventv1.Event as corebilling's billing_events.payload
// holds it and its bus carries it (protojson).
type billingEvent struct {
	ID        string            `json:"id"`
	Subject   string            `json:"subject"`
	TenantID  string            `json:"tenantId"`
	CreatedAt string            `json:"createdAt"`
	Data      map[string]any    `json:"data"`
	Metadata  map[string]string `json:"metadata"`
}

// idempotencyTracker is the document's outbox.IdempotencyTracker: it
// rejects an event id seen within the window (default 10 minutes).
type idempotencyTracker struct {
	mu     sync.Mutex
	window time.Duration
	seen   map[string]time.Time
}

func (t *idempotencyTracker) SeenBefore(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if at, ok := t.seen[id]; ok && time.Since(at) < t.window {
		return true
	}
	t.seen[id] = time.Now()
	return false
}

// corebilling (seeds/001): each event is published on its own subject, the
// event type as written ("subscription.created", never
// "...subscription.subscription_created"), as the event corebilling's bus
// carries (id, subject, tenantId, createdAt, data, metadata with
// correlation_id), with its ULID id as Nats-Msg-Id and the correlation-id
// and tenant-id headers. A consumer written with nats.go from the
// document (subscribe to the subject, dedupe by event id through the
// IdempotencyTracker's window, ack after handling) applies every event once
// and in order. The retry path is the dispatcher's, as the document's: a
// failed publish is retried with backoff and published once; one that
// reaches the retry limit moves to the dead letters (fifobox's dead state)
// and holds its resource's later events.
func TestCorebillingConsumerUnchanged(t *testing.T) {
	t.Parallel()
	url := privateNATS(t)
	ctx := context.Background()
	prof := load(t, "corebilling")
	m := mapper(t, prof, wire.TransportNATS)
	cfg := fifonats.Config{URL: url, Topology: fifonats.Holdco(), Wire: m, Logger: quiet}
	prov, err := fifonats.NewProfileProvisioner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := prov.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if err := prov.Provision(ctx); err != nil {
		t.Fatalf("second provision: %v", err)
	}

	// The consumer, from the document: subscribe, dedupe, handle, ack.
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	tracker := &idempotencyTracker{window: 10 * time.Minute, seen: map[string]time.Time{}}
	type applied struct {
		ev      billingEvent
		subject string
		header  nats.Header
	}
	var mu sync.Mutex
	var got []applied
	sub, err := js.Subscribe("subscription.>", func(msg *nats.Msg) {
		var ev billingEvent
		if err := json.Unmarshal(msg.Data, &ev); err != nil {
			_ = msg.Nak()
			return
		}
		if !tracker.SeenBefore(ev.ID) {
			mu.Lock()
			got = append(got, applied{ev: ev, subject: msg.Subject, header: msg.Header})
			mu.Unlock()
		}
		_ = msg.Ack()
	}, nats.ManualAck(), nats.DeliverAll())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })

	db := pgtest.New(t)
	type event struct {
		env envelope.Envelope
		n   int
	}
	var events []event
	var retried, doomed event
	for s := 0; s < 3; s++ {
		resource := fmt.Sprintf("sub_%d", s)
		for n, typ := range []string{"subscription.created", "subscription.trialing", "subscription.activated", "subscription.renewed"} {
			id := uuid.UUID(ulid.Make()).String() // corebilling's ids are ULIDs
			e := event{n: n + 1, env: envelope.Envelope{ID: id, Type: typ, OccurredAt: time.Now().UTC().Truncate(time.Microsecond), AggregateType: "subscription",
				AggregateID: resource, TenantID: "tnt_1", CorrelationID: "corr-" + resource, SchemaVersion: 1,
				Payload: json.RawMessage(fmt.Sprintf(`{"id":%q,"customer_id":"cus_1","n":%d}`, resource, n+1))}}
			events = append(events, e)
			switch {
			case s == 1 && n == 1:
				retried = e
			case s == 2 && n == 2:
				doomed = e
			}
		}
	}
	// The document's producers: a row in billing_events with its ULID, the
	// event in the payload and the outbox metadata beside it; fifobox's
	// capture delivers it.
	app := producers(t, db, prof, "corebilling", "outbox.sql")
	for _, e := range events {
		payload, _ := json.Marshal(map[string]any{"id": wire.ULID.Format(e.env.ID), "subject": e.env.Type, "tenantId": e.env.TenantID,
			"createdAt": e.env.OccurredAt.Format(time.RFC3339Nano), "data": e.env.Payload,
			"metadata": map[string]any{"correlation_id": e.env.CorrelationID, "outbox_status": "pending", "outbox_retry_count": 0}})
		if _, err := app.Pool.Exec(ctx, `INSERT INTO billing_events (id, subject, tenant_id, resource_id, payload, created_at)
			VALUES ($1, $2, $3, $4, $5, $6)`, wire.ULID.Format(e.env.ID), e.env.Type, e.env.TenantID, e.env.AggregateID, string(payload),
			e.env.OccurredAt); err != nil {
			t.Fatal(err)
		}
	}
	pub, err := fifonats.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	dispatch(t, db, failFirst(failFirst(pub, 2, retried.env.ID), 1000, doomed.env.ID),
		func(c *outbox.DispatcherConfig) { c.MaxAttempts = 4 })

	// Every event but the doomed one and its resource's later one.
	want := len(events) - 2
	eventually(t, time.Minute, "every publishable event applied", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) >= want
	})
	var state, lastErr string
	var attempts int
	eventually(t, 30*time.Second, "the doomed event dead", func() bool {
		_ = db.Pool.QueryRow(ctx, `SELECT state, attempts, coalesce(last_error, '') FROM outbox_events WHERE event_id = $1`, doomed.env.ID).Scan(&state, &attempts, &lastErr)
		return state == "dead"
	})
	if attempts != 4 || !strings.Contains(lastErr, "injected") {
		t.Errorf("doomed event: %d attempts, last error %q", attempts, lastErr)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT state, attempts FROM outbox_events WHERE event_id = $1`, retried.env.ID).Scan(&state, &attempts); err != nil || state != "sent" || attempts != 3 {
		t.Errorf("retried event: %s after %d attempts (%v), want sent after 3", state, attempts, err)
	}
	// The metadata in billing_events tells the truth: dispatched, and the
	// doomed event dead_letter with its last error.
	var dispatched, dead int
	var statusErr error
	eventually(t, 30*time.Second, "billing_events' metadata updated", func() bool {
		statusErr = app.Pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE payload #>> '{metadata,outbox_status}' = 'dispatched'),
			count(*) FILTER (WHERE payload #>> '{metadata,outbox_status}' = 'dead_letter' AND payload #>> '{metadata,outbox_last_error}' LIKE '%injected%' AND id = $1)
			FROM billing_events`, wire.ULID.Format(doomed.env.ID)).Scan(&dispatched, &dead)
		return statusErr == nil && dispatched >= want && dead == 1
	})
	if dispatched != want {
		t.Errorf("billing_events: %d dispatched, want %d", dispatched, want)
	}
	time.Sleep(time.Second) // a duplicate would arrive now

	mu.Lock()
	defer mu.Unlock()
	byULID := map[string]event{}
	for _, e := range events {
		byULID[wire.ULID.Format(e.env.ID)] = e
	}
	last := map[string]int{}
	for _, a := range got {
		e, ok := byULID[a.ev.ID]
		if !ok {
			t.Fatalf("applied %q: not a ULID of an enqueued event", a.ev.ID)
		}
		if e.env.ID == doomed.env.ID {
			t.Errorf("the doomed event was published")
		}
		resource := e.env.AggregateID
		if e.n != last[resource]+1 {
			t.Errorf("%s: event %d applied after %d", resource, e.n, last[resource])
		}
		last[resource] = e.n
		if a.subject != e.env.Type || a.ev.Subject != e.env.Type || a.ev.TenantID != "tnt_1" ||
			a.ev.CreatedAt != e.env.OccurredAt.Format(time.RFC3339Nano) || a.ev.Data["id"] != resource ||
			a.ev.Metadata["correlation_id"] != "corr-"+resource || a.header.Get("Nats-Msg-Id") != a.ev.ID ||
			a.header.Get("correlation-id") != "corr-"+resource || a.header.Get("tenant-id") != "tnt_1" {
			t.Errorf("%s: subject %q, event %+v, headers %v", e.env.ID, a.subject, a.ev, a.header)
		}
	}
	if len(got) != want {
		t.Errorf("%d events applied, want %d (the doomed event and its resource's next held back)", len(got), want)
	}
}
