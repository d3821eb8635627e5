package amqp_test

import (
	"context"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
)

// The default policy setter (FIFOBOX_AMQP_POLICIES unset: the management
// API, as on Amazon MQ) against the real broker's API: a policy set on the
// test's vhost reaches the queue it matches, and a definition the broker
// refuses comes back as an error naming the policy, without credentials.
func TestManagementPoliciesSetAndRead(t *testing.T) {
	t.Parallel()
	v := amqptest.New(t)
	mp, err := amqp.NewManagementPolicies("", v.URL)
	if err != nil {
		t.Fatal(err)
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
	for _, q := range []string{"mp.matched", "other"} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	err = mp.SetPolicies(ctx, v.Name, []amqp.Policy{{Name: "mp-test", Pattern: `^mp\.`, Definition: map[string]any{"max-length": 1000}, Priority: 1}})
	if err != nil {
		t.Fatalf("SetPolicies: %v", err)
	}
	// The API reports a queue's policy from its statistics, a few seconds behind.
	var got map[string]string
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		if got, err = mp.QueuePolicies(ctx, v.Name); err != nil {
			t.Fatalf("QueuePolicies: %v", err)
		}
		if got["mp.matched"] == "mp-test" {
			break
		}
	}
	if got["mp.matched"] != "mp-test" || got["other"] != "" {
		t.Fatalf("QueuePolicies = %v, want mp.matched following mp-test and other none", got)
	}

	err = mp.SetPolicies(ctx, v.Name, []amqp.Policy{{Name: "mp-bad", Pattern: `^mp\.`, Definition: map[string]any{"max-length": "many"}}})
	if err == nil || !strings.Contains(err.Error(), "policy mp-bad") || !strings.Contains(err.Error(), "400") {
		t.Fatalf("SetPolicies with a refused definition: %v, want an error naming mp-bad with the broker's 400", err)
	}
	if strings.Contains(err.Error(), "guest@") || strings.Contains(err.Error(), v.URL) {
		t.Fatalf("error %q carries the AMQP URL or credentials", err)
	}
}
