package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
)

// With FIFOBOX_TRANSPORT=rabbitmq, `fifobox status` reports the RabbitMQ
// topology's queues (here holdco's, in a test vhost) instead of SQS's.
func TestStatusThroughRabbitMQ(t *testing.T) {
	v := amqptest.New(t)
	prov, err := amqp.NewProvisioner(amqp.Config{URL: v.URL, Topology: amqp.Holdco()})
	if err != nil {
		t.Fatal(err)
	}
	if err := prov.Provision(context.Background()); err != nil {
		t.Fatal(err)
	}
	db := pgtest.New(t)
	t.Setenv("FIFOBOX_TRANSPORT", "rabbitmq")
	t.Setenv("FIFOBOX_AMQP_URL", v.URL)
	t.Setenv("FIFOBOX_AMQP_TOPOLOGY", "holdco")
	t.Setenv("FIFOBOX_REDRIVE_FUNCTION", "")
	out, errOut, err := runCLI(t, "--database-url", pgtest.WithSearchPath(pgtest.URL(), db.Schema), "--json", "status")
	if err != nil {
		t.Fatalf("status: %v: %s", err, errOut)
	}
	var res redrive.Result
	if err := json.Unmarshal([]byte(out), &res); err != nil || res.Status == nil {
		t.Fatalf("output %q: %v", out, err)
	}
	got := map[string]bool{}
	for _, q := range res.Status.Queues {
		if q.Error != "" {
			t.Errorf("%s: %s", q.Consumer, q.Error)
		}
		got[q.Consumer] = true
	}
	if len(got) != 3 || !got["analytics"] || !got["erp"] || !got["notifications"] {
		t.Fatalf("queues %v, want holdco's analytics, erp and notifications", got)
	}
	t.Setenv("FIFOBOX_TRANSPORT", "kafka")
	if _, _, err := runCLI(t, "--database-url", pgtest.WithSearchPath(pgtest.URL(), db.Schema), "status"); err == nil {
		t.Error("FIFOBOX_TRANSPORT=kafka accepted")
	}
}
