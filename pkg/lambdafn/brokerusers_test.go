package lambdafn_test

import (
	"context"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/lambdafn"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

// The provisioning function reads each function's broker user from its own
// secret; a bad entry fails naming the variable and the role, never a value.
func TestBrokerUserSecrets(t *testing.T) {
	secrets := map[string]string{
		"arn:admin": `{"username":"fifobox","password":"admin-pw"}`,
		"arn:d":     `{"username":"fifobox-dispatcher","password":"d-pw"}`,
		"arn:o":     `{"username":"fifobox-operations","password":"o-pw"}`,
		"arn:c":     `{"username":"fifobox-consumer-inventory","password":"c-pw"}`,
		"arn:bad":   `{"username":"x"}`,
	}
	fetch := func(_ context.Context, arn string) (string, error) { return secrets[arn], nil }
	setup := func(t *testing.T, users string) lambdafn.Broker {
		clearBrokerEnv(t)
		t.Setenv("FIFOBOX_TRANSPORT", "rabbitmq")
		t.Setenv("FIFOBOX_AMQP_TOPOLOGY", "ticketing")
		t.Setenv("FIFOBOX_AMQP_URL", "amqps://b-1.mq.us-east-1.amazonaws.com:5671/prod")
		t.Setenv("FIFOBOX_AMQP_SECRET_ARN", "arn:admin")
		t.Setenv(lambdafn.EnvAMQPUserSecrets, users)
		b, err := lambdafn.BrokerFromEnv()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	b := setup(t, `{"dispatcher":"arn:d","operations":"arn:o","consumer:inventory":"arn:c"}`)
	if err := b.Credentials(context.Background(), fetch); err != nil {
		t.Fatal(err)
	}
	want := []amqp.User{
		{Name: "fifobox-consumer-inventory", Password: "c-pw", Role: amqp.RoleConsumer, Consumer: "inventory"},
		{Name: "fifobox-dispatcher", Password: "d-pw", Role: amqp.RoleDispatcher},
		{Name: "fifobox-operations", Password: "o-pw", Role: amqp.RoleOperations},
	}
	if len(b.AMQP.Users) != len(want) {
		t.Fatalf("users %v, want %v", b.AMQP.Users, want)
	}
	for i := range want {
		if b.AMQP.Users[i] != want[i] {
			t.Errorf("user %d: %v, want %v", i, b.AMQP.Users[i], want[i])
		}
	}
	for _, bad := range []string{`{"admin":"arn:d"}`, `{"consumer:nobody":"arn:c"}`, `{"dispatcher":"arn:bad"}`, `[1]`} {
		b := setup(t, bad)
		err := b.Credentials(context.Background(), fetch)
		if err == nil || !strings.Contains(err.Error(), lambdafn.EnvAMQPUserSecrets) || strings.Contains(err.Error(), "-pw") {
			t.Errorf("%s: %v, want an error naming %s and no password", bad, err, lambdafn.EnvAMQPUserSecrets)
		}
	}
}
