package redrive_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
)

// With another transport's broker (RabbitMQ here, the holdco topology),
// status reports its queues, replay sends a consumer only the events its
// bindings select, in order, and dlq-redrive moves its dead messages back,
// each audited.
func TestBrokerOperationsThroughRabbitMQ(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := amqptest.New(t)
	cfg := amqp.Config{URL: v.URL, Topology: amqp.Holdco(), Logger: quiet}
	prov, err := amqp.NewProvisioner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := prov.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	ops, err := amqp.NewOperations(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ops.Close()

	db := pgtest.New(t)
	var evs []envelope.Envelope
	for _, e := range [][2]string{{"invoice", "created"}, {"order", "created"}, {"payment_intent", "failed"}, {"invoice", "paid"}} {
		ev := event(e[0], e[0]+"-1", e[1])
		evs = append(evs, ev)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { return outbox.Enqueue(ctx, tx, evs...) }); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE outbox SET state = 'sent', sent_at = now()`); err != nil {
		t.Fatal(err)
	}
	svc, err := redrive.New(db.Pool, redrive.Config{Operations: ops, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	depth := func(consumer string) redrive.QueueDepth {
		res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpStatus, Consumer: consumer})
		if err != nil || res.Status == nil || len(res.Status.Queues.Consumers) != 1 {
			t.Fatalf("status %s: %+v %v", consumer, res, err)
		}
		return res.Status.Queues.Consumers[0]
	}
	if d := depth("erp"); d.Visible != 0 || d.DLQ != 0 || d.Error != "" {
		t.Fatalf("erp before: %+v", d)
	}

	epoch := time.Unix(0, 0).UTC()
	for _, tc := range []struct {
		aggType string
		want    int64
	}{{"invoice", 2}, {"order", 0}} { // erp binds invoice.* and payment_intent.*, not order.*
		res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpReplay, Consumer: "erp", AggregateType: tc.aggType, Since: &redrive.Instant{Time: epoch}, Actor: "test"})
		if err != nil || res.Affected != tc.want {
			t.Fatalf("replay %s events to erp: %+v %v, want %d", tc.aggType, res, err, tc.want)
		}
	}
	eventually(t, func() bool { return depth("erp").Visible == 2 })
	if d := depth("notifications"); d.Visible != 0 {
		t.Fatalf("notifications got %d replayed messages, want none", d.Visible)
	}

	// A dead message in erp's DLQ goes back to erp's queue.
	conn, err := amqp091.Dial(v.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	body, _ := evs[0].Encode()
	if err := ch.PublishWithContext(ctx, "", "erp.sync.dlq", false, false, amqp091.Publishing{MessageId: evs[0].ID, Body: body,
		Headers: amqp091.Table{"x-aggregate-id": evs[0].AggregateID}}); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() bool { return depth("erp").DLQ == 1 })
	res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpDLQRedrive, Consumer: "erp", Max: 10, Actor: "test"})
	if err != nil || res.Affected != 1 || res.AuditID == 0 {
		t.Fatalf("dlq-redrive: %+v %v", res, err)
	}
	eventually(t, func() bool { d := depth("erp"); return d.DLQ == 0 && d.Visible == 3 })
}

func eventually(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// migrate with a Provisioner (the operations function of a broker
// deployment, run by the deploy trigger) applies the migrations and
// declares the broker's topology; a failing provisioner fails migrate and
// its audit row says why.
func TestMigrateProvisionsBrokerTopology(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	v := amqptest.New(t)
	cfg := amqp.Config{URL: v.URL, Topology: amqp.Ticketing(), Logger: quiet}
	ops, err := amqp.NewOperations(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ops.Close()
	before, err := ops.Depths(ctx, "inventory")
	if err != nil {
		t.Fatal(err)
	}
	if len(before) != 1 || before[0].Error == "" {
		t.Fatalf("inventory's queue before migrate: %+v, want an error (not declared yet)", before)
	}

	prov, err := amqp.NewProvisioner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	db := pgtest.New(t)
	svc, err := redrive.New(db.Pool, redrive.Config{Operations: ops, Provisioner: prov, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ { // idempotent: every deploy runs it again
		res, err := svc.Execute(ctx, redrive.Command{Operation: redrive.OpMigrate, Actor: "deploy"})
		if err != nil || !strings.HasSuffix(res.Message, "; broker topology provisioned") {
			t.Fatalf("migrate %d: %+v %v", i, res, err)
		}
	}
	after, err := ops.Depths(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != 2 {
		t.Fatalf("depths after migrate: %+v, want inventory and notification", after)
	}
	for _, d := range after {
		if d.Error != "" || d.Ready != 0 || d.DLQ != 0 {
			t.Errorf("%s after migrate: %+v", d.Consumer, d)
		}
	}

	failing, err := redrive.New(db.Pool, redrive.Config{Operations: ops, Provisioner: failingProvisioner{}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := failing.Execute(ctx, redrive.Command{Operation: redrive.OpMigrate, Actor: "deploy"}); err == nil {
		t.Fatal("migrate succeeded with a failing provisioner")
	}
	var status, text string
	if err := db.Pool.QueryRow(ctx, `SELECT status, coalesce(error, '') FROM redrive_audit WHERE operation = 'migrate' ORDER BY id DESC LIMIT 1`).Scan(&status, &text); err != nil {
		t.Fatal(err)
	}
	if status != "failed" || !strings.Contains(text, "provision broker topology: broker unreachable") {
		t.Errorf("audit of the failed migrate: %s %q", status, text)
	}
}

type failingProvisioner struct{}

func (failingProvisioner) Provision(context.Context) error { return errors.New("broker unreachable") }
