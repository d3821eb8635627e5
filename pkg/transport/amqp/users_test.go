package amqp_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/url"
	"os/exec"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	"github.com/fifobox/fifobox/pkg/transport/amqp/amqptest"
)

// brokerOp is one thing a user tries on its own channel.
type brokerOp struct {
	name string
	run  func(ch *amqp091.Channel) error
}

func publishOp(exchange, key string) brokerOp {
	return brokerOp{"publish to " + quoteExchange(exchange) + " key " + key, func(ch *amqp091.Channel) error {
		if err := ch.Confirm(false); err != nil {
			return err
		}
		closed := ch.NotifyClose(make(chan *amqp091.Error, 1))
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), exchange, key, false, false,
			amqp091.Publishing{MessageId: "m", Body: []byte(`{}`), DeliveryMode: amqp091.Persistent})
		if err != nil {
			return err
		}
		select {
		case <-dc.Done():
			if dc.Acked() {
				return nil
			}
			if e := <-closed; e != nil {
				return e
			}
			return errors.New("nacked")
		case e := <-closed:
			return e
		case <-time.After(10 * time.Second):
			return errors.New("no confirm")
		}
	}}
}

func quoteExchange(x string) string {
	if x == "" {
		return "the default exchange"
	}
	return x
}

func consumeOp(q string) brokerOp {
	return brokerOp{"consume " + q, func(ch *amqp091.Channel) error {
		_, err := ch.Consume(q, "", false, false, false, false, nil)
		return err
	}}
}

func getOp(q string) brokerOp {
	return brokerOp{"basic.get " + q, func(ch *amqp091.Channel) error {
		_, _, err := ch.Get(q, false)
		return err
	}}
}

func declareOp(q string) brokerOp {
	return brokerOp{"declare queue " + q, func(ch *amqp091.Channel) error {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		return err
	}}
}

func deleteOp(q string) brokerOp {
	return brokerOp{"delete queue " + q, func(ch *amqp091.Channel) error {
		_, err := ch.QueueDelete(q, false, false, false)
		return err
	}}
}

func purgeOp(q string) brokerOp {
	return brokerOp{"purge queue " + q, func(ch *amqp091.Channel) error {
		_, err := ch.QueuePurge(q, false)
		return err
	}}
}

// TestEachFunctionsBrokerUserCanDoOnlyItsJob provisions the ticketing
// topology with one user per function in a fresh vhost (through the
// management API, as on Amazon MQ), then logs in as each and tries what
// the function does (allowed) and what it must not do (refused: 403
// ACCESS_REFUSED): a compromised consumer cannot read another consumer's
// queue, publish events, write into another queue or delete anything.
// (RabbitMQ ties purge to read: a user that may consume a queue may purge
// it, which is no more than consuming and acknowledging everything.)
func TestEachFunctionsBrokerUserCanDoOnlyItsJob(t *testing.T) {
	t.Parallel()
	v := amqptest.New(t)
	topo := amqp.Ticketing()
	suffix := strings.TrimPrefix(v.Name, "fifobox-test-")
	users := map[string]amqp.User{}
	for _, key := range []string{"dispatcher", "operations", "consumer:inventory", "consumer:notification"} {
		role, consumer, err := amqp.ParseUserKey(key)
		if err != nil {
			t.Fatal(err)
		}
		b := make([]byte, 12)
		_, _ = rand.Read(b)
		name := "fbt-" + suffix + "-" + strings.ReplaceAll(key, ":", "-")
		users[key] = amqp.User{Name: name, Password: hex.EncodeToString(b) + "/@:%", Role: role, Consumer: consumer}
		t.Cleanup(func() { amqptest.DeleteUser(t, name) })
	}
	cfg := amqp.Config{URL: v.URL, Topology: topo, Logger: quiet}
	for _, u := range users {
		cfg.Users = append(cfg.Users, u)
	}
	p, err := amqp.NewProvisioner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := p.Provision(ctx); err != nil {
		t.Fatalf("provision with users: %v (is the management plugin on? scripts/ensure-rabbitmq.sh)", err)
	}
	if err := p.Provision(ctx); err != nil {
		t.Fatalf("provision again (idempotent): %v", err)
	}
	urlAs := func(key string) string {
		u, _ := url.Parse(v.URL)
		u.User = url.UserPassword(users[key].Name, users[key].Password)
		return u.String()
	}

	inv, note := topo.Consumers[0], topo.Consumers[1]
	x, dlx := topo.Exchange.Name, "ticketing.events.dlx"
	cases := map[string]struct{ allowed, refused []brokerOp }{
		"dispatcher": {
			allowed: []brokerOp{publishOp(x, "hold.created")},
			refused: []brokerOp{publishOp(dlx, inv.DLQName()), publishOp("", inv.QueueName()), publishOp(inv.SettleExchange(), inv.DLQName()),
				consumeOp(inv.QueueName()), getOp(inv.DLQName()), declareOp("evil"), deleteOp(inv.QueueName()), purgeOp(inv.QueueName())},
		},
		"consumer:inventory": {
			allowed: []brokerOp{consumeOp(inv.QueueName()), publishOp(inv.SettleExchange(), inv.DLQName()),
				publishOp(inv.SettleExchange(), inv.RetryQueueName(1))},
			refused: []brokerOp{consumeOp(note.QueueName()), publishOp(note.SettleExchange(), note.DLQName()), publishOp(x, "order.confirmed"),
				publishOp("", note.QueueName()), publishOp(dlx, note.DLQName()), getOp(inv.DLQName()),
				declareOp("evil"), deleteOp(inv.QueueName()), purgeOp(note.QueueName())},
		},
		"operations": {
			allowed: []brokerOp{getOp(inv.DLQName()), getOp(note.DLQName()), publishOp("", inv.QueueName())},
			refused: []brokerOp{consumeOp(inv.QueueName()), getOp(note.QueueName()), publishOp(x, "order.confirmed"), publishOp(dlx, inv.DLQName()),
				publishOp(inv.SettleExchange(), inv.DLQName()), declareOp("evil"), deleteOp(inv.DLQName()), purgeOp(inv.QueueName())},
		},
	}
	for key, c := range cases {
		conn, err := amqp091.Dial(urlAs(key))
		if err != nil {
			t.Fatalf("%s: log in: %v", key, err)
		}
		for _, op := range c.allowed {
			ch, err := conn.Channel()
			if err != nil {
				t.Fatal(err)
			}
			if err := op.run(ch); err != nil {
				t.Errorf("%s may %s, but: %v", key, op.name, err)
			}
			_ = ch.Close()
		}
		for _, op := range c.refused {
			ch, err := conn.Channel()
			if err != nil {
				t.Fatal(err)
			}
			err = op.run(ch)
			var ae *amqp091.Error
			if !errors.As(err, &ae) || ae.Code != amqp091.AccessRefused {
				t.Errorf("%s must not %s: got %v, want 403 ACCESS_REFUSED", key, op.name, err)
			}
			_ = ch.Close()
		}
		_ = conn.Close()
	}
	// Another vhost is out of reach altogether.
	other := amqptest.New(t)
	u, _ := url.Parse(urlAs("operations"))
	u.Path = "/" + other.Name
	if c, err := amqp091.Dial(u.String()); err == nil {
		c.Close()
		t.Errorf("operations logged in to another vhost")
	}
	// The administrator's password is the provisioner's alone: a function's
	// user cannot create users (the management API refuses it).
	fnAsAdmin := cfg
	fnAsAdmin.URL = urlAs("operations")
	fnAsAdmin.Users = []amqp.User{{Name: "fbt-" + suffix + "-evil", Password: "x", Role: amqp.RoleDispatcher}}
	t.Cleanup(func() { _ = exec.Command("rabbitmqctl", "-q", "delete_user", "fbt-"+suffix+"-evil").Run() })
	if p, err := amqp.NewProvisioner(fnAsAdmin); err != nil {
		t.Fatal(err)
	} else if err := p.Provision(ctx); err == nil {
		t.Errorf("a function's user provisioned the topology and a user")
	}

	// The functions' own code paths work as their users: the publisher as
	// the dispatcher, redrive and depths as operations.
	dcfg := cfg
	dcfg.URL, dcfg.Users = urlAs("dispatcher"), nil
	pub := newPublisher(t, dcfg)
	m := message(newEvent("hold", "h-1", "hold.created", 1))
	if err := pub.Publish(ctx, []outbox.Message{m})[0]; err != nil {
		t.Fatalf("publish as the dispatcher: %v", err)
	}
	ocfg := cfg
	ocfg.URL, ocfg.Users = urlAs("operations"), nil
	ops, err := amqp.NewOperations(ocfg)
	if err != nil {
		t.Fatal(err)
	}
	defer ops.Close()
	if res, err := ops.Redrive(ctx, transport.RedriveRequest{Consumer: "inventory", Max: 10}); err != nil || res.Moved != 1 {
		t.Fatalf("redrive as operations: %+v, %v; want the one dead letter the consumer sent", res, err)
	}
	depths, err := ops.Depths(ctx)
	if err != nil {
		t.Fatalf("depths as operations: %v", err)
	}
	for _, d := range depths {
		if d.Error != "" {
			t.Errorf("depths as operations: %s: %s", d.Consumer, d.Error)
		}
	}
}

func TestPermissionsNameOnlyTheTopologysEntities(t *testing.T) {
	topo := amqp.Ticketing()
	if err := topo.Prepare(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		role, consumer string
		want           amqp.Permissions
	}{
		{amqp.RoleDispatcher, "", amqp.Permissions{Configure: "^$", Write: `^(ticketing\.events)$`, Read: "^$"}},
		{amqp.RoleConsumer, "inventory", amqp.Permissions{Configure: "^$", Write: `^(ticketing\.inventory\.settle)$`, Read: `^(ticketing\.inventory)$`}},
		{amqp.RoleOperations, "", amqp.Permissions{Configure: "^$", Write: `^(amq\.default)$`, Read: `^(ticketing\.inventory\.dlq|ticketing\.notification\.dlq)$`}},
	} {
		got, err := topo.Permissions(tc.role, tc.consumer)
		if err != nil || got != tc.want {
			t.Errorf("%s %s: %+v %v, want %+v", tc.role, tc.consumer, got, err, tc.want)
		}
	}
	if _, err := topo.Permissions(amqp.RoleConsumer, "nobody"); err == nil {
		t.Error("permissions for a consumer not in the topology")
	}
	for _, k := range []string{"admin", "consumer", "consumer:", "dispatcher:x"} {
		if _, _, err := amqp.ParseUserKey(k); err == nil {
			t.Errorf("ParseUserKey(%q) accepted", k)
		}
	}
}
