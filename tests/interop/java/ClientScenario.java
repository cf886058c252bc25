// A client-compatibility scenario run with the RabbitMQ Java client (Debian's
// librabbitmq-client-java) against one AMQP endpoint.
//
// Usage: java -cp <classes>:<jars> ClientScenario HOST PORT VHOST QUEUE_PREFIX
//
// It prints one "key=value" line per observation and decides nothing itself:
// tests/test_clients.py compares the lines with what RabbitMQ does, so a
// failure shows the whole picture as a dict diff. Exit status 0 means every
// step ran (the observations may still be wrong); anything thrown is printed
// as "error=..." with exit status 1.

import com.rabbitmq.client.AMQP;
import com.rabbitmq.client.Channel;
import com.rabbitmq.client.ConfirmListener;
import com.rabbitmq.client.Connection;
import com.rabbitmq.client.ConnectionFactory;
import com.rabbitmq.client.DefaultConsumer;
import com.rabbitmq.client.Envelope;
import com.rabbitmq.client.GetResponse;
import com.rabbitmq.client.MessageProperties;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.NavigableSet;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.ConcurrentSkipListSet;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

public final class ClientScenario {
    private static final int CONFIRMED_MESSAGES = 100;

    private ClientScenario() {}

    /** One delivery as the consumer saw it. */
    private static final class Delivery {
        final long tag;
        final String body;
        final boolean redelivered;

        Delivery(long tag, String body, boolean redelivered) {
            this.tag = tag;
            this.body = body;
            this.redelivered = redelivered;
        }
    }

    private static void report(String key, Object value) {
        System.out.println(key + "=" + value);
    }

    private static byte[] utf8(String s) {
        return s.getBytes(StandardCharsets.UTF_8);
    }

    private static String text(byte[] b) {
        return new String(b, StandardCharsets.UTF_8);
    }

    private static String freshQueue(Channel ch, String name) throws Exception {
        ch.queueDeclare(name, true, false, false, null);
        return name;
    }

    private static int depth(Connection conn, String queue) throws Exception {
        Channel ch = conn.createChannel();
        try {
            return ch.queueDeclarePassive(queue).getMessageCount();
        } finally {
            ch.close();
        }
    }

    /** 100 persistent 1 KiB messages, every one confirmed, all in the queue. */
    static void publishWithConfirms(Connection conn, String queue) throws Exception {
        Channel ch = conn.createChannel();
        freshQueue(ch, queue);
        ch.confirmSelect();
        NavigableSet<Long> outstanding = new ConcurrentSkipListSet<>();
        AtomicInteger acked = new AtomicInteger();
        AtomicInteger nacked = new AtomicInteger();
        ch.addConfirmListener(new ConfirmListener() {
            @Override
            public void handleAck(long tag, boolean multiple) {
                acked.addAndGet(settle(outstanding, tag, multiple));
            }

            @Override
            public void handleNack(long tag, boolean multiple) {
                nacked.addAndGet(settle(outstanding, tag, multiple));
            }
        });
        byte[] pad = new byte[1024 - 8];
        Arrays.fill(pad, (byte) 'x');
        for (int i = 0; i < CONFIRMED_MESSAGES; i++) {
            byte[] body = new byte[1024];
            byte[] head = utf8(String.format("%08d", i));
            System.arraycopy(head, 0, body, 0, 8);
            System.arraycopy(pad, 0, body, 8, pad.length);
            outstanding.add(ch.getNextPublishSeqNo());
            ch.basicPublish("", queue, MessageProperties.PERSISTENT_BASIC, body);
        }
        ch.waitForConfirmsOrDie(20_000);
        report("confirm.published", CONFIRMED_MESSAGES);
        report("confirm.acked", acked.get());
        report("confirm.nacked", nacked.get());
        report("confirm.outstanding", outstanding.size());
        ch.close();
        report("confirm.depth", depth(conn, queue));
        Channel reader = conn.createChannel();
        List<String> heads = new ArrayList<>();
        boolean persistent = true;
        GetResponse r;
        while ((r = reader.basicGet(queue, true)) != null) {
            heads.add(text(Arrays.copyOf(r.getBody(), 8)));
            persistent &= Integer.valueOf(2).equals(r.getProps().getDeliveryMode());
            persistent &= r.getBody().length == 1024;
        }
        reader.close();
        List<String> expected = new ArrayList<>();
        for (int i = 0; i < CONFIRMED_MESSAGES; i++) {
            expected.add(String.format("%08d", i));
        }
        report("confirm.in_order", heads.equals(expected));
        report("confirm.persistent_1k", persistent);
    }

    private static int settle(NavigableSet<Long> outstanding, long tag, boolean multiple) {
        if (!multiple) {
            return outstanding.remove(tag) ? 1 : 0;
        }
        NavigableSet<Long> done = outstanding.headSet(tag, true);
        int n = done.size();
        done.clear();
        return n;
    }

    /** ack, ack multiple, nack without requeue, reject, nack with requeue. */
    static void consumeAcks(Connection conn, String queue) throws Exception {
        Channel ch = conn.createChannel();
        freshQueue(ch, queue);
        for (int i = 0; i < 6; i++) {
            ch.basicPublish("", queue, MessageProperties.PERSISTENT_BASIC, utf8("m" + i));
        }
        BlockingQueue<Delivery> inbox = new LinkedBlockingQueue<>();
        ch.basicQos(10);
        String ctag = ch.basicConsume(queue, false, new DefaultConsumer(ch) {
            @Override
            public void handleDelivery(
                    String consumerTag, Envelope env, AMQP.BasicProperties props, byte[] body) {
                inbox.add(new Delivery(env.getDeliveryTag(), text(body), env.isRedeliver()));
            }
        });
        List<Delivery> first = new ArrayList<>();
        for (int i = 0; i < 6; i++) {
            Delivery d = inbox.poll(10, TimeUnit.SECONDS);
            if (d == null) {
                throw new IllegalStateException("only " + i + " of 6 deliveries arrived");
            }
            first.add(d);
        }
        List<String> order = new ArrayList<>();
        for (Delivery d : first) {
            order.add(d.body + (d.redelivered ? "!" : ""));
        }
        report("consume.order", String.join(",", order));
        ch.basicAck(first.get(1).tag, true); // m0 and m1
        ch.basicNack(first.get(2).tag, false, false); // m2 gone
        ch.basicReject(first.get(3).tag, false); // m3 gone
        ch.basicNack(first.get(4).tag, false, true); // m4 back to the queue
        Delivery again = inbox.poll(10, TimeUnit.SECONDS);
        report("consume.redelivered", again == null ? "none" : again.body + ":" + again.redelivered);
        if (again != null) {
            ch.basicAck(again.tag, false);
        }
        ch.basicAck(first.get(5).tag, false);
        ch.basicCancel(ctag);
        Delivery extra = inbox.poll(300, TimeUnit.MILLISECONDS);
        report("consume.extra", extra == null ? "none" : extra.body);
        ch.close(); // would requeue anything still unacked
        report("consume.left", depth(conn, queue));
    }

    /** basic.get with properties and remaining count, then get-empty. */
    static void basicGet(Connection conn, String queue) throws Exception {
        Channel ch = conn.createChannel();
        freshQueue(ch, queue);
        Map<String, Object> headers = new HashMap<>();
        headers.put("k", "v");
        AMQP.BasicProperties props = new AMQP.BasicProperties.Builder()
                .contentType("text/plain")
                .correlationId("corr-1")
                .deliveryMode(2)
                .headers(headers)
                .build();
        ch.basicPublish("", queue, props, utf8("g0"));
        ch.basicPublish("", queue, props, utf8("g1"));
        GetResponse r0 = ch.basicGet(queue, false);
        report("get.first", text(r0.getBody()));
        report("get.remaining", r0.getMessageCount());
        report("get.content_type", r0.getProps().getContentType());
        report("get.correlation_id", r0.getProps().getCorrelationId());
        report("get.header.k", String.valueOf(r0.getProps().getHeaders().get("k")));
        ch.basicAck(r0.getEnvelope().getDeliveryTag(), false);
        GetResponse r1 = ch.basicGet(queue, true);
        report("get.second", text(r1.getBody()));
        report("get.second_remaining", r1.getMessageCount());
        report("get.empty", ch.basicGet(queue, true) == null);
        ch.close();
    }

    /** tx.commit makes publish+ack visible; tx.rollback undoes both. */
    static void transactions(Connection conn, String queue) throws Exception {
        Channel plain = conn.createChannel();
        freshQueue(plain, queue);
        plain.basicPublish("", queue, MessageProperties.PERSISTENT_BASIC, utf8("old"));
        Channel tx = conn.createChannel();
        tx.txSelect();
        GetResponse old = tx.basicGet(queue, false);
        tx.basicPublish("", queue, MessageProperties.PERSISTENT_BASIC, utf8("new"));
        tx.basicAck(old.getEnvelope().getDeliveryTag(), false);
        report("tx.depth_before_commit", depth(conn, queue));
        tx.txCommit();
        report("tx.depth_after_commit", depth(conn, queue));

        GetResponse fresh = tx.basicGet(queue, false);
        report("tx.got_after_commit", text(fresh.getBody()));
        tx.basicPublish("", queue, MessageProperties.PERSISTENT_BASIC, utf8("newer"));
        tx.basicAck(fresh.getEnvelope().getDeliveryTag(), false);
        tx.txRollback();
        report("tx.depth_after_rollback", depth(conn, queue));
        tx.close(); // the un-acked "new" goes back to the queue
        GetResponse back = plain.basicGet(queue, true);
        report("tx.after_close", back == null ? "none" : text(back.getBody()) + ":"
                + back.getEnvelope().isRedeliver());
        report("tx.then_empty", plain.basicGet(queue, true) == null);
        plain.close();
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 4) {
            System.err.println("usage: ClientScenario HOST PORT VHOST QUEUE_PREFIX");
            System.exit(2);
        }
        ConnectionFactory factory = new ConnectionFactory();
        factory.setHost(args[0]);
        factory.setPort(Integer.parseInt(args[1]));
        factory.setVirtualHost(args[2]);
        factory.setUsername("guest");
        factory.setPassword("guest");
        factory.setAutomaticRecoveryEnabled(false);
        String prefix = args[3];
        Connection conn = factory.newConnection("client-scenario");
        try {
            report("client.version", conn.getClientProperties().get("version"));
            publishWithConfirms(conn, prefix + ".confirm");
            consumeAcks(conn, prefix + ".consume");
            basicGet(conn, prefix + ".get");
            transactions(conn, prefix + ".tx");
            report("done", true);
        } catch (Exception e) {
            report("error", e.toString().replace('\n', ' '));
            System.exit(1);
        } finally {
            if (conn.isOpen()) {
                conn.close();
            }
        }
    }
}
